//! Bounds on what a tree may be (issue 14, point 1): nesting past
//! `DEPTH_MAX`, expansion past `EXPANDED_ENTRIES_MAX`,
//! `EXPANDED_FILE_BYTES_MAX` or `EXPANDED_BLOCK_REFS_MAX`, distinct trees
//! past `DISTINCT_TREE_BYTES_MAX` and sizes that overflow are refused with
//! an error naming the bound and the path or the tree, and no
//! walk (scan, push, pull, gc, verify, stats) recurses with its input: the
//! hostile cases run on 256 KiB stacks, threads and rayon workers alike,
//! where such recursion overflows long before the input ends.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use store::backend::MemoryBackend;
use store::gc;
use store::index::{Index, IndexKey};
use store::store::ObjectId;
use store::tree::{
    DEPTH_MAX, DISTINCT_TREE_BYTES_MAX, EXPANDED_BLOCK_REFS_MAX, EXPANDED_ENTRIES_MAX,
    EXPANDED_FILE_BYTES_MAX, Entry, EntryKind, Tree,
};
use store::{Digest, Error, OrgId, Store};

use crate::support::{home, on_two_threads, org, pull, push, push_options, snapshot, tempdir};

/// Small enough that a walk recursing once per level of a few hundred
/// levels overflows it (a debug build's frames are large).
const SMALL_STACK_BYTES: usize = 256 * 1024;
/// What the runner's and the CLI's worker threads get (Rust's default).
const DEFAULT_STACK_BYTES: usize = 2 * 1024 * 1024;

/// Runs `work` on a thread with a stack of `stack_bytes`, inside a rayon
/// pool whose workers have the same, so recursion anywhere in the walk is
/// caught (an overflow aborts the whole test binary).
fn on_stacks<T: Send + 'static>(
    stack_bytes: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    std::thread::Builder::new()
        .stack_size(stack_bytes)
        .spawn(move || {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .stack_size(stack_bytes)
                .build()
                .expect("thread pool");
            pool.install(work)
        })
        .expect("spawn")
        .join()
        .expect("the work does not panic")
}

/// Shared with the thread the work runs on.
fn memory_store() -> Arc<Store> {
    Arc::new(Store::new(Arc::new(MemoryBackend::default())))
}

fn put_tree(store: &Store, org: &OrgId, tree: Tree) -> Digest {
    let (digest, bytes) = tree.encode().expect("a valid tree");
    store
        .put_object(org, &ObjectId::tree(digest), &bytes)
        .expect("store the tree");
    digest
}

fn dir_entry(name: &str, tree: Digest) -> Entry {
    Entry {
        name: name.as_bytes().to_vec(),
        mode: 0o755,
        size: 0,
        mtime_ns: 1_700_000_000_000_000_000,
        kind: EntryKind::Dir { tree },
    }
}

/// `levels` trees nested in one another (`d/d/…`), each its own object:
/// the root nests `levels` directories.
fn put_chain(store: &Store, org: &OrgId, levels: usize) -> Digest {
    let mut digest = put_tree(store, org, Tree::default());
    for _ in 0..levels {
        digest = put_tree(
            store,
            org,
            Tree {
                entries: vec![dir_entry("d", digest)],
            },
        );
    }
    digest
}

/// `d/d/…` nested `levels` deep under `root`, with a file at the bottom.
fn nested_home(root: &Path, levels: usize) -> PathBuf {
    let mut deepest = root.to_path_buf();
    for _ in 0..levels {
        deepest.push("d");
    }
    fs::create_dir_all(&deepest).expect("mkdir -p");
    fs::write(deepest.join("bottom"), b"the bottom").expect("write");
    deepest
}

fn assert_too_deep(result: Result<impl std::fmt::Debug, Error>) {
    match result {
        Err(Error::TooDeep { path, depth_max }) => {
            assert_eq!(depth_max, DEPTH_MAX);
            assert_eq!(path.components().count(), DEPTH_MAX + 1, "{path:?}");
            let message = Error::TooDeep { path, depth_max }.to_string();
            assert!(message.contains("too deep"), "{message}");
        }
        other => panic!("expected TooDeep, got {other:?}"),
    }
}

fn is_empty_dir(dir: &Path) -> bool {
    fs::read_dir(dir).map_or(true, |mut entries| entries.next().is_none())
}

#[test]
fn a_home_nested_past_the_bound_is_refused_at_push_without_a_crash() {
    let src = tempdir();
    nested_home(src.path(), 700);
    let store = memory_store();
    let (src_path, pushed_store) = (src.path().to_owned(), Arc::clone(&store));
    let result = on_stacks(SMALL_STACK_BYTES, move || {
        push(&pushed_store, &org("acme"), &home("deep"), &src_path)
    });
    assert_too_deep(result);
    assert_eq!(
        store.read_home(&org("acme"), &home("deep")).expect("read"),
        None,
        "no pointer to a tree no pull would take"
    );
}

#[test]
fn a_home_nested_to_the_bound_round_trips() {
    let (src, dest) = (tempdir(), tempdir());
    nested_home(src.path(), DEPTH_MAX);
    let store = memory_store();
    let (src_path, dest_path, worked) = (
        src.path().to_owned(),
        dest.path().to_owned(),
        Arc::clone(&store),
    );
    on_stacks(DEFAULT_STACK_BYTES, move || {
        let acme = org("acme");
        push(&worked, &acme, &home("deep"), &src_path).expect("push");
        pull(&worked, &acme, &home("deep"), &dest_path).expect("pull");
        assert!(gc::verify(&worked).expect("verify").ok());
    });
    assert_eq!(snapshot(dest.path()), snapshot(src.path()));
}

#[test]
fn hostile_deep_trees_fail_pull_naming_the_path_and_gc_verify_stats_survive() {
    let store = memory_store();
    let acme = org("acme");
    for (name, levels) in [("six-hundred", 600), ("three-thousand", 3000)] {
        let root = put_chain(&store, &acme, levels);
        store.write_home(&acme, &home(name), &root).expect("point");
    }
    // Unreferenced, so gc condemns and orders it: its height is computed
    // over 5000 levels.
    put_chain(&store, &org("other"), 5000);
    let worked = Arc::clone(&store);
    on_stacks(SMALL_STACK_BYTES, move || {
        for name in ["six-hundred", "three-thousand"] {
            let dest = tempdir();
            assert_too_deep(pull(&worked, &org("acme"), &home(name), dest.path()));
            assert!(is_empty_dir(dest.path()), "nothing written before refusing");
        }
        let report = gc::gc(&worked, Duration::ZERO).expect("gc");
        assert_eq!(report.deleted, 5001, "the unreferenced chain, nothing else");
        let verified = gc::verify(&worked).expect("verify");
        assert!(verified.ok(), "{:?}", verified.errors);
        let stats = gc::stats(&worked).expect("stats");
        assert_eq!(stats.iter().map(|s| s.homes).sum::<u64>(), 2);
    });
}

#[test]
fn a_dag_expanding_past_the_bound_is_refused_before_writing() {
    let store = memory_store();
    let acme = org("acme");
    // 64 symlinks, then three levels of 64 directories each naming the
    // level below: a few kilobytes that expand to 17 million entries.
    let leaf = Tree {
        entries: (0..64)
            .map(|i| Entry {
                name: format!("l{i:02}").into_bytes(),
                mode: 0o777,
                size: 1,
                mtime_ns: 0,
                kind: EntryKind::Symlink {
                    target: b"x".to_vec(),
                },
            })
            .collect(),
    };
    let mut digest = put_tree(&store, &acme, leaf);
    for _ in 0..3 {
        let entries = (0..64)
            .map(|i| dir_entry(&format!("d{i:02}"), digest))
            .collect();
        digest = put_tree(&store, &acme, Tree { entries });
    }
    store
        .write_home(&acme, &home("dag"), &digest)
        .expect("point");
    let dest = tempdir();
    let (worked, dest_path) = (Arc::clone(&store), dest.path().to_owned());
    let result = on_stacks(SMALL_STACK_BYTES, move || {
        pull(&worked, &org("acme"), &home("dag"), &dest_path)
    });
    match result {
        Err(Error::TooManyEntries { what, entries_max }) => {
            assert_eq!(entries_max, EXPANDED_ENTRIES_MAX);
            assert!(what.contains(&digest.to_string()), "{what}");
        }
        other => panic!("expected TooManyEntries, got {other:?}"),
    }
    assert!(is_empty_dir(dest.path()));
}

#[test]
fn declared_sizes_that_overflow_are_refused() {
    let child = Tree::default().encode().expect("empty").0;
    let mut big = dir_entry("a", child);
    big.size = u64::MAX;
    let mut one = dir_entry("b", child);
    one.size = 1;
    let tree = Tree {
        entries: vec![big, one],
    };
    assert!(
        matches!(tree.clone().encode(), Err(Error::MalformedTree { .. })),
        "encode refuses"
    );
    let bytes = tree.encode_unchecked();
    let digest = Digest::of(&bytes);
    match Tree::decode(&digest, &bytes) {
        Err(Error::MalformedTree {
            digest: named,
            reason,
        }) => {
            assert_eq!(named, digest);
            assert!(reason.contains("overflow"), "{reason}");
        }
        other => panic!("expected MalformedTree, got {other:?}"),
    }
    // The block service's rule refuses it too, storing nothing.
    let store = memory_store();
    let acme = org("acme");
    store
        .put_object(
            &acme,
            &ObjectId::tree(child),
            &Tree::default().encode().expect("empty").1,
        )
        .expect("child");
    let stored = store::block::encode(&bytes);
    let refused =
        store::objects::put_batch_checked(&*store, &acme, &[(ObjectId::tree(digest), &stored)]);
    assert!(
        matches!(refused, Err(Error::MalformedTree { .. })),
        "{refused:?}"
    );
    assert!(matches!(
        store.get_tree(&acme, &digest),
        Err(Error::MissingObject { .. })
    ));
}

#[test]
fn pull_removes_a_deeply_nested_directory_the_tree_lacks() {
    let (src, dest) = (tempdir(), tempdir());
    fs::write(src.path().join("kept"), b"kept").expect("write");
    // What a sandbox left in its home: nested deeper than any tree may be.
    nested_home(&dest.path().join("junk"), 700);
    let store = memory_store();
    push(&store, &org("acme"), &home("h"), src.path()).expect("push");
    let (worked, dest_path) = (Arc::clone(&store), dest.path().to_owned());
    on_stacks(SMALL_STACK_BYTES, move || {
        pull(&worked, &org("acme"), &home("h"), &dest_path).expect("pull")
    });
    assert_eq!(snapshot(dest.path()), snapshot(src.path()));
}

const SPLIT_BLOCK_BYTES: u64 = store::block::SPLIT_BLOCK_BYTES;

/// A file of `blocks` 4 MiB blocks, every one of them the same digest:
/// its entry is `blocks` × 32 bytes, its stored tree a few kilobytes.
fn huge_file(name: &str, blocks: u64) -> Entry {
    Entry {
        name: name.as_bytes().to_vec(),
        mode: 0o644,
        size: blocks * SPLIT_BLOCK_BYTES,
        mtime_ns: 0,
        kind: EntryKind::File {
            blocks: vec![Digest::of(b"one block"); blocks as usize],
        },
    }
}

/// Pulls `name` of acme on small stacks into an empty directory, which
/// must stay empty; the pull's error.
fn refused_pull(store: &Arc<Store>, name: &'static str) -> Error {
    let dest = tempdir();
    let (worked, dest_path) = (Arc::clone(store), dest.path().to_owned());
    let result = on_stacks(SMALL_STACK_BYTES, move || {
        pull(&worked, &org("acme"), &home(name), &dest_path)
    });
    assert!(is_empty_dir(dest.path()), "nothing written before refusing");
    result.expect_err("the pull is refused")
}

/// Regression (audit, pull memory bomb): only entries were bounded, so a
/// few kilobytes of stored trees (one file of 200,000 blocks of one
/// digest, under 20 levels of directories each naming the level below
/// twice: 2^20 copies, 3 million entries) expanded to 160 EiB of files and
/// 2×10^11 block references, each copied into the pull's memory. Refused
/// before a byte is written, naming the bound.
#[test]
fn regression_a_dag_of_huge_files_is_refused_before_writing() {
    let store = memory_store();
    let acme = org("acme");
    let mut digest = put_tree(
        &store,
        &acme,
        Tree {
            entries: vec![huge_file("f", 200_000)],
        },
    );
    for _ in 0..20 {
        digest = put_tree(
            &store,
            &acme,
            Tree {
                entries: vec![dir_entry("a", digest), dir_entry("b", digest)],
            },
        );
    }
    store
        .write_home(&acme, &home("bomb"), &digest)
        .expect("point");
    match refused_pull(&store, "bomb") {
        Error::TooManyFileBytes {
            what,
            file_bytes_max,
        } => {
            assert_eq!(file_bytes_max, EXPANDED_FILE_BYTES_MAX);
            assert!(what.contains(&digest.to_string()), "{what}");
            let message = Error::TooManyFileBytes {
                what,
                file_bytes_max,
            }
            .to_string();
            assert!(message.contains("bytes of files"), "{message}");
        }
        other => panic!("expected TooManyFileBytes, got {other:?}"),
    }
}

/// Within the entries and file bytes bounds, block references are bounded
/// too: 3.3 million empty files (a block each) and five references to a
/// 781 GiB file (a million blocks) pass 4 Mi references.
#[test]
fn a_dag_past_the_block_reference_bound_is_refused_before_writing() {
    let store = memory_store();
    let acme = org("acme");
    let empty = |name: String| Entry {
        name: name.into_bytes(),
        mode: 0o644,
        size: 0,
        mtime_ns: 0,
        kind: EntryKind::File {
            blocks: vec![Digest::of(b"")],
        },
    };
    let mut digest = put_tree(
        &store,
        &acme,
        Tree {
            entries: (0..256).map(|i| empty(format!("e{i:03}"))).collect(),
        },
    );
    for fanout in [256, 50] {
        let entries = (0..fanout)
            .map(|i| dir_entry(&format!("d{i:03}"), digest))
            .collect();
        digest = put_tree(&store, &acme, Tree { entries });
    }
    let big = put_tree(
        &store,
        &acme,
        Tree {
            entries: vec![huge_file("f", 200_000)],
        },
    );
    let mut entries = vec![dir_entry("t", digest)];
    entries.extend((0..5).map(|i| dir_entry(&format!("b{i}"), big)));
    let root = put_tree(&store, &acme, Tree { entries });
    store
        .write_home(&acme, &home("refs"), &root)
        .expect("point");
    match refused_pull(&store, "refs") {
        Error::TooManyBlockRefs {
            what,
            block_refs_max,
        } => {
            assert_eq!(block_refs_max, EXPANDED_BLOCK_REFS_MAX);
            assert!(what.contains(&root.to_string()), "{what}");
        }
        other => panic!("expected TooManyBlockRefs, got {other:?}"),
    }
}

/// Distinct trees are bounded in bytes, as they arrive: 131 trees of
/// 2,000 symlinks to 4 KiB targets (8 MiB each decoded, kilobytes
/// stored) pass 1 GiB, which a pull would otherwise hold whole.
#[test]
fn trees_past_the_tree_bytes_bound_are_refused_before_writing() {
    let store = memory_store();
    let acme = org("acme");
    let target = vec![b'x'; store::tree::SYMLINK_TARGET_BYTES_MAX];
    let entries = (0..131)
        .map(|t| {
            let links = (0..2_000)
                .map(|i| Entry {
                    name: format!("t{t:03}-{i:04}").into_bytes(),
                    mode: 0o777,
                    size: target.len() as u64,
                    mtime_ns: 0,
                    kind: EntryKind::Symlink {
                        target: target.clone(),
                    },
                })
                .collect();
            dir_entry(
                &format!("d{t:03}"),
                put_tree(&store, &acme, Tree { entries: links }),
            )
        })
        .collect();
    let root = put_tree(&store, &acme, Tree { entries });
    store
        .write_home(&acme, &home("listings"), &root)
        .expect("point");
    match refused_pull(&store, "listings") {
        Error::TooManyTreeBytes {
            what,
            tree_bytes_max,
        } => {
            assert_eq!(tree_bytes_max, DISTINCT_TREE_BYTES_MAX);
            assert!(what.contains(&root.to_string()), "{what}");
        }
        other => panic!("expected TooManyTreeBytes, got {other:?}"),
    }
}

/// What scan makes, pull takes: a home whose files pass the file bytes
/// bound fails its push, naming the bound, and no home points anywhere.
/// Nine sparse files of 500 GiB, already in the index (so not read).
#[test]
fn a_home_past_the_file_bytes_bound_fails_its_push_and_commits_nothing() {
    let (src, state) = (tempdir(), tempdir());
    let size = 500 << 30;
    let mut index = Index::default();
    for i in 0..9 {
        let path = src.path().join(format!("sparse{i}"));
        let file = fs::File::create(&path).expect("create");
        file.set_len(size).expect("a sparse file");
        let key = IndexKey::of(&file.metadata().expect("stat"));
        let blocks = vec![Digest::of(b"zeros"); (size / SPLIT_BLOCK_BYTES) as usize];
        index.files.insert(key, blocks);
    }
    let index_path = state.path().join("index");
    index.save(&index_path).expect("save the index");
    let store = memory_store();
    let mut options = push_options();
    options.index_path = Some(index_path);
    let pushed = on_two_threads(|| {
        store::push::push(
            &store,
            &org("acme"),
            &home("big"),
            src.path(),
            &options,
            &store::progress::NoProgress,
        )
    });
    match pushed {
        Err(Error::TooManyFileBytes {
            what,
            file_bytes_max,
        }) => {
            assert_eq!(file_bytes_max, EXPANDED_FILE_BYTES_MAX);
            assert!(what.contains(&src.path().display().to_string()), "{what}");
        }
        other => panic!("expected TooManyFileBytes, got {other:?}"),
    }
    assert_eq!(
        store.read_home(&org("acme"), &home("big")).expect("read"),
        None,
        "nothing committed"
    );
}

/// Audit finding: a tree within the global bounds (4 TiB of files) still
/// expanded past the runner's free disk, which every tenant shares: a few
/// KB of trees filled it. With `check_room`, a pull into an empty
/// directory of a tree larger than the space free there is refused
/// before a byte is written, and the error is a full disk.
#[test]
fn a_tree_past_the_free_space_where_it_goes_is_refused_before_writing() {
    let dest = tempdir();
    let stat = rustix::fs::statvfs(dest.path()).expect("statvfs");
    let free = stat.f_bavail * stat.f_frsize;
    let blocks = free / SPLIT_BLOCK_BYTES + 256;
    assert!(
        blocks * SPLIT_BLOCK_BYTES <= EXPANDED_FILE_BYTES_MAX,
        "the test's disk has more than 4 TiB free"
    );
    let store = memory_store();
    let acme = org("acme");
    let root = put_tree(
        &store,
        &acme,
        Tree {
            entries: vec![huge_file("big", blocks)],
        },
    );
    store.write_home(&acme, &home("big"), &root).expect("point");
    let mut options = crate::support::pull_options();
    options.check_room = true;
    let (worked, dest_path) = (Arc::clone(&store), dest.path().to_owned());
    let result = on_stacks(SMALL_STACK_BYTES, move || {
        store::pull::pull(
            &worked,
            &org("acme"),
            &home("big"),
            &dest_path,
            &options,
            &store::progress::NoProgress,
        )
    });
    assert!(is_empty_dir(dest.path()), "nothing written before refusing");
    match result {
        Err(err @ Error::NoRoom { .. }) => {
            assert!(err.is_disk_full(), "{err}");
            assert!(err.to_string().contains("free"), "{err}");
        }
        other => panic!("expected NoRoom, got {other:?}"),
    }

    // A loop-mounted destination reports its image's size as free: the
    // file system under it (`room_also`) must hold the bytes too. /proc
    // has none free.
    let small = put_tree(
        &store,
        &acme,
        Tree {
            entries: vec![huge_file("small", 1)],
        },
    );
    store
        .write_home(&acme, &home("small"), &small)
        .expect("point");
    let dest = tempdir();
    let mut options = crate::support::pull_options();
    options.check_room = true;
    options.room_also = Some(PathBuf::from("/proc"));
    let (worked, dest_path) = (Arc::clone(&store), dest.path().to_owned());
    let result = on_stacks(SMALL_STACK_BYTES, move || {
        store::pull::pull(
            &worked,
            &org("acme"),
            &home("small"),
            &dest_path,
            &options,
            &store::progress::NoProgress,
        )
    });
    assert!(is_empty_dir(dest.path()), "nothing written before refusing");
    match result {
        Err(Error::NoRoom { path, .. }) => assert_eq!(path, PathBuf::from("/proc")),
        other => panic!("expected NoRoom under /proc, got {other:?}"),
    }
}

/// Audit finding: one upload batch of a few hundred KB (the same highly
/// compressible 8 MiB frame, 1,024 times) cost the server 8 GiB of
/// decompressing and hashing. An object repeated in a batch is decoded
/// and stored once, and a batch decompressing past
/// `BATCH_PLAIN_BYTES_MAX` is refused whole.
#[test]
fn an_upload_batch_is_bounded_by_what_it_decompresses_to() {
    let store = memory_store();
    let acme = org("acme");
    let plain = vec![7u8; 4 << 20];
    let digest = Digest::of(&plain);
    let stored = store::block::encode(&plain);
    let repeated: Vec<(ObjectId, &[u8])> = (0..1024)
        .map(|_| (ObjectId::block(digest), stored.as_slice()))
        .collect();
    store::objects::put_batch_checked(&*store, &acme, &repeated)
        .expect("one object, sent 1,024 times, is 4 MiB");
    assert!(store.get_object(&acme, &ObjectId::block(digest)).is_ok());

    let blocks: Vec<(ObjectId, Vec<u8>)> = (0..=(store::objects::BATCH_PLAIN_BYTES_MAX >> 22))
        .map(|n| {
            let plain = vec![n as u8 + 8; 4 << 20];
            (
                ObjectId::block(Digest::of(&plain)),
                store::block::encode(&plain),
            )
        })
        .collect();
    let refused = store::objects::put_batch_checked(&*store, &acme, &blocks);
    assert!(
        matches!(refused, Err(Error::BatchTooLarge { .. })),
        "{refused:?}"
    );
    assert!(
        blocks
            .iter()
            .all(|(object, _)| store.get_object(&acme, object).is_err()),
        "nothing of a refused batch is stored"
    );
}
