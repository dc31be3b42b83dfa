//! The engine end to end, through the library: push, pull, gc and verify
//! over real directories and the local, memory and S3 backends.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use store::backend::{Backend, LocalBackend, MemoryBackend};
use store::gc;
use store::progress::NoProgress;
use store::store::{MISSING_CHECK_BATCH_MAX, ObjectId};
use store::tree::EntryKind;
use store::{Digest, Error, HomeName, Objects, OrgId, Store};

use crate::support::{
    Double, Faults, Node, as_pulled, assert_present_trees_are_complete, assert_verify_ok, contents,
    corrupt_stored, home, home_dir, object_keys, org, pull, push, push_options, reachable,
    set_mtime, snapshot, tempdir, write_files, write_nodes,
};

/// Longer than the racy-timestamp window (100 ms): files written before it
/// can be trusted by their stat in the file index.
const PAST_RACY_WINDOW: Duration = Duration::from_millis(250);

/// One fixed mtime for generated homes, so equal content makes equal trees
/// (a tree records its entries' mtimes).
const FIXED_MTIME_NS: i64 = 1_600_000_000_123_456_789;

const OLD: &[(&str, &[u8])] = &[
    ("src/main.rs", b"fn main() { old(); }\n"),
    ("src/util/mod.rs", b"pub fn util() {}\n"),
    ("src/util/deep/er/leaf.rs", b"// the old leaf\n"),
    (
        "docs/guide/intro.md",
        b"# intro\nshared by several versions\n",
    ),
    ("docs/readme.md", b"# readme\n"),
    ("notes.txt", b"old notes\n"),
];

const NEW: &[(&str, &[u8])] = &[
    ("src/main.rs", b"fn main() { new(); }\n"),
    ("src/util/mod.rs", b"pub fn util() {}\n"),
    (
        "docs/guide/intro.md",
        b"# intro\nshared by several versions\n",
    ),
    ("docs/readme.md", b"# readme\n"),
    ("todo.txt", b"new todo\n"),
];

/// A temp dir holding `files`, every entry's mtime set to [`FIXED_MTIME_NS`].
fn fixed_home(files: &[(&str, &[u8])]) -> tempfile::TempDir {
    let dir = home_dir(files);
    fix_mtimes(dir.path());
    dir
}

fn fix_mtimes(dir: &Path) {
    // Setting a child's times leaves its parent's mtime alone.
    for path in snapshot(dir).keys() {
        set_mtime(&dir.join(path), FIXED_MTIME_NS);
    }
}

fn memory_store() -> Store {
    Store::new(Arc::new(MemoryBackend::default()))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn root_of(store: &Store, org: &OrgId, home: &HomeName) -> Digest {
    store
        .read_home(org, home)
        .expect("read pointer")
        .expect("home exists")
}

/// The digest of the directory at `path` (relative, `/`-separated) in `root`.
fn subtree(store: &Store, org: &OrgId, root: Digest, path: &str) -> Digest {
    path.split('/').fold(root, |digest, name| {
        let tree = store.get_tree(org, &digest).expect("tree");
        let entry = tree
            .entries
            .into_iter()
            .find(|entry| entry.name == name.as_bytes())
            .unwrap_or_else(|| panic!("no entry {name:?} in {path}"));
        match entry.kind {
            EntryKind::Dir { tree } => tree,
            other => panic!("{name:?} is not a directory: {other:?}"),
        }
    })
}

fn file_blocks(store: &Store, org: &OrgId, root: Digest, path: &str) -> Vec<Digest> {
    let (dir, name) = path
        .rsplit_once('/')
        .map_or((None, path), |(d, n)| (Some(d), n));
    let parent = dir.map_or(root, |dir| subtree(store, org, root, dir));
    let tree = store.get_tree(org, &parent).expect("tree");
    match tree
        .entries
        .into_iter()
        .find(|entry| entry.name == name.as_bytes())
        .map(|entry| entry.kind)
    {
        Some(EntryKind::File { blocks }) => blocks,
        other => panic!("{path} is not a file: {other:?}"),
    }
}

// ---------------------------------------------------------------------------
// Round trips

fn arb_name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // A small pool, so the two homes of a case reuse names with other
        // types and contents (the in-place update has to replace them).
        4 => prop::sample::select(vec![
            b"a".to_vec(),
            b"b".to_vec(),
            b".hidden".to_vec(),
            b"caf\xc3\xa9".to_vec(),
            b"\xff\xfe not utf-8".to_vec(),
            b"line\nbreak".to_vec(),
        ]),
        2 => prop::collection::vec(1u8..=255, 1..16)
            .prop_filter("a valid file name", |name| store::tree::is_valid_name(name)),
        1 => Just(vec![b'n'; store::tree::NAME_BYTES_MAX]),
    ]
}

fn arb_content() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        prop::collection::vec(any::<u8>(), 1..4000),
        // Compressible: stored as a zstd frame.
        (any::<u8>(), 64..50_000usize).prop_map(|(byte, len)| vec![byte; len]),
    ]
}

fn arb_mtime() -> impl Strategy<Value = i64> {
    // Before and after 1970, with nanoseconds; within what ext4 and xfs keep.
    (-2_000_000_000i64..2_000_000_000, 0i64..1_000_000_000)
        .prop_map(|(seconds, nanos)| seconds * 1_000_000_000 + nanos)
}

fn arb_node() -> impl Strategy<Value = Node> {
    // Setuid and setgid modes too: pushed and pulled without those bits.
    let file_mode = prop::sample::select(vec![0o644u32, 0o600, 0o755, 0o400, 0o640, 0o4755]);
    let dir_mode = || prop::sample::select(vec![0o755u32, 0o700, 0o750, 0o2775]);
    let target = prop_oneof![
        prop::sample::select(vec![
            b"../../../etc/passwd".to_vec(),
            b"/tmp".to_vec(),
            b"a".to_vec(),
        ]),
        prop::collection::vec(1u8..=255, 1..80),
    ];
    let leaf = prop_oneof![
        4 => (arb_content(), file_mode, arb_mtime()).prop_map(|(content, mode, mtime_ns)| {
            Node::File { content, mode, mtime_ns }
        }),
        1 => (target, arb_mtime()).prop_map(|(target, mtime_ns)| Node::Symlink { target, mtime_ns }),
        1 => (dir_mode(), arb_mtime()).prop_map(|(mode, mtime_ns)| Node::Dir {
            entries: BTreeMap::new(),
            mode,
            mtime_ns,
        }),
    ];
    leaf.prop_recursive(3, 24, 5, move |inner| {
        (
            prop::collection::btree_map(arb_name(), inner, 0..5),
            dir_mode(),
            arb_mtime(),
        )
            .prop_map(|(entries, mode, mtime_ns)| Node::Dir {
                entries,
                mode,
                mtime_ns,
            })
    })
}

fn arb_home() -> impl Strategy<Value = BTreeMap<Vec<u8>, Node>> {
    prop::collection::btree_map(arb_name(), arb_node(), 0..6)
}

fn round_trip(first: &BTreeMap<Vec<u8>, Node>, second: &BTreeMap<Vec<u8>, Node>) {
    // Both ways of fetching: object by object, and in batches (as from the
    // block service).
    round_trip_through(memory_store(), first, second);
    let batching = Store::new(Double::batching(Arc::new(MemoryBackend::default())));
    round_trip_through(batching, first, second);
}

fn round_trip_through(
    store: Store,
    first: &BTreeMap<Vec<u8>, Node>,
    second: &BTreeMap<Vec<u8>, Node>,
) {
    let (acme, alice) = (org("acme"), home("alice"));
    let first_dir = tempdir();
    write_nodes(first_dir.path(), first);
    let second_dir = tempdir();
    write_nodes(second_dir.path(), second);
    // The destination's file index goes through every step, so files the
    // index says are unchanged take the in-place "touch up" path.
    let index_dir = tempdir();
    let mut pull_options = crate::support::pull_options();
    pull_options.index_path = Some(index_dir.path().join("index"));
    let mut copy_options = push_options();
    copy_options.index_path = pull_options.index_path.clone();

    let pushed = push(&store, &acme, &alice, first_dir.path()).expect("push the first home");
    let dest = tempdir();
    store::pull::pull(
        &store,
        &acme,
        &alice,
        dest.path(),
        &pull_options,
        &NoProgress,
    )
    .expect("pull into an empty dir");
    assert_eq!(
        snapshot(dest.path()),
        as_pulled(first_dir.path()),
        "pull into an empty dir"
    );
    // Nothing is lost or added on the way (and the index the pull wrote
    // names the right blocks): the copy is the same tree.
    let copy = store::push::push(
        &store,
        &acme,
        &home("copy"),
        dest.path(),
        &copy_options,
        &NoProgress,
    )
    .expect("push the copy");
    assert_eq!(
        copy.root, pushed.root,
        "the pulled copy pushes the same root"
    );
    assert_eq!((copy.blocks_uploaded, copy.trees_uploaded), (0, 0));

    push(&store, &acme, &alice, second_dir.path()).expect("push the second home");
    store::pull::pull(
        &store,
        &acme,
        &alice,
        dest.path(),
        &pull_options,
        &NoProgress,
    )
    .expect("pull over the older home");
    assert_eq!(
        snapshot(dest.path()),
        as_pulled(second_dir.path()),
        "in-place update over the first home"
    );
}

/// A second version of `home` sharing most of its content: files keep
/// their content but some change mode or mtime, and some entries of
/// `other` are laid over it.
fn edited(
    home: &BTreeMap<Vec<u8>, Node>,
    other: &BTreeMap<Vec<u8>, Node>,
    seed: u64,
) -> BTreeMap<Vec<u8>, Node> {
    fn step(state: &mut u64) -> u64 {
        *state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        *state >> 33
    }
    fn retouch(node: &Node, state: &mut u64) -> Node {
        match node {
            Node::File {
                content,
                mode,
                mtime_ns,
            } => {
                let (mode, mtime_ns) = match step(state) % 3 {
                    0 => (*mode, *mtime_ns),
                    1 => (if *mode == 0o600 { 0o644 } else { 0o600 }, *mtime_ns),
                    _ => (*mode, mtime_ns + 1_000_000_007),
                };
                Node::File {
                    content: content.clone(),
                    mode,
                    mtime_ns,
                }
            }
            Node::Dir {
                entries,
                mode,
                mtime_ns,
            } => Node::Dir {
                entries: entries
                    .iter()
                    .map(|(name, child)| (name.clone(), retouch(child, state)))
                    .collect(),
                mode: *mode,
                mtime_ns: *mtime_ns,
            },
            Node::Symlink { .. } => node.clone(),
        }
    }
    let mut state = seed;
    let mut out: BTreeMap<Vec<u8>, Node> = home
        .iter()
        .map(|(name, node)| (name.clone(), retouch(node, &mut state)))
        .collect();
    for (name, node) in other {
        if step(&mut state) & 1 == 0 {
            out.insert(name.clone(), node.clone());
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// Random homes (nested and empty dirs, files of any size including 0,
    /// modes, symlinks, non-UTF-8 names, old and new mtimes) come back
    /// exactly, into an empty dir and over a dir holding another version
    /// (unrelated, or an edit of the first).
    #[test]
    fn random_homes_round_trip_through_push_and_pull(
        first in arb_home(),
        other in arb_home(),
        seed in any::<u64>(),
        unrelated in any::<bool>(),
    ) {
        let second = if unrelated { other } else { edited(&first, &other, seed) };
        round_trip(&first, &second);
    }
}

/// Files larger than one block are split into 4 MiB blocks; an all-zero
/// block comes back as a hole.
#[test]
fn large_files_split_into_blocks_and_zero_blocks_stay_holes() {
    const MIB: usize = 1024 * 1024;
    let random = |len: usize, seed: u64| -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    };
    let exactly_one_block = random(8 * MIB, 1);
    let one_byte_over = random(8 * MIB + 1, 2);
    let mut sparse = random(12 * MIB, 3);
    sparse[4 * MIB..8 * MIB].fill(0);
    let src = home_dir(&[
        ("one", &exactly_one_block),
        ("over", &one_byte_over),
        ("sparse", &sparse),
    ]);
    let store = memory_store();
    let (acme, alice) = (org("acme"), home("alice"));
    let root = push(&store, &acme, &alice, src.path())
        .expect("push")
        .root
        .expect("root");
    for (name, blocks) in [("one", 1), ("over", 3), ("sparse", 3)] {
        assert_eq!(
            file_blocks(&store, &acme, root, name).len(),
            blocks,
            "{name}"
        );
    }
    let dest = tempdir();
    pull(&store, &acme, &alice, dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));
    let allocated = fs::metadata(dest.path().join("sparse"))
        .expect("stat")
        .blocks()
        * 512;
    assert!(
        allocated <= 9 * MIB as u64,
        "the zero block was written out: {allocated} bytes allocated"
    );
}

// ---------------------------------------------------------------------------
// Push: what it asks and uploads

/// The incremental push of a one-file change deep in a tree asks the store
/// at most twice and uploads one block and the trees on the path to it.
#[test]
fn incremental_push_of_a_deep_change_uploads_only_its_path() {
    const DEPTH: u64 = 5;
    let src = home_dir(&[
        ("top.txt", b"top"),
        ("d1/s1.txt", b"s1"),
        ("d1/d2/s2.txt", b"s2"),
        ("d1/d2/side/x.txt", b"side"),
        ("d1/d2/d3/s3.txt", b"s3"),
        ("d1/d2/d3/d4/s4.txt", b"s4"),
        ("d1/d2/d3/d4/d5/leaf.txt", b"leaf v1"),
        ("d1/d2/d3/d4/d5/other.txt", b"other"),
        ("elsewhere/a/b/c.txt", b"c"),
    ]);
    let index_dir = tempdir();
    let mut options = push_options();
    options.index_path = Some(index_dir.path().join("index"));
    let store = memory_store();
    let (acme, alice) = (org("acme"), home("alice"));
    let push_now = || {
        store::push::push(&store, &acme, &alice, src.path(), &options, &NoProgress).expect("push")
    };

    std::thread::sleep(PAST_RACY_WINDOW);
    let first = push_now();
    assert_eq!(first.files, 9);

    write_files(src.path(), &[("d1/d2/d3/d4/d5/leaf.txt", b"leaf v2")]);
    std::thread::sleep(PAST_RACY_WINDOW);
    let second = push_now();
    assert!(
        second.missing_checks <= 2,
        "{} missing-checks",
        second.missing_checks
    );
    assert_eq!(second.blocks_uploaded, 1);
    assert_eq!(second.trees_uploaded, DEPTH + 1);
    assert_eq!(
        second.files_hashed, 1,
        "only the changed file is read again"
    );

    let third = push_now();
    assert!(third.unchanged);
    assert_eq!(
        (
            third.missing_checks,
            third.blocks_uploaded,
            third.trees_uploaded,
            third.files_hashed
        ),
        (0, 0, 0, 0)
    );

    let dest = tempdir();
    pull(&store, &acme, &alice, dest.path()).expect("pull");
    assert_eq!(snapshot(dest.path()), snapshot(src.path()));
}

/// However many objects a push asks about, no single existence request
/// carries more than `MISSING_CHECK_BATCH_MAX` keys: on the pruned walk of
/// a first push and on the incremental path.
#[test]
fn oversized_missing_checks_are_split() {
    let files: Vec<(String, Vec<u8>)> = (0..10_000)
        .map(|i| (format!("f{i:05}"), format!("tiny file {i}\n").into_bytes()))
        .collect();
    let as_refs = |range: std::ops::Range<usize>| -> Vec<(&str, &[u8])> {
        files[range]
            .iter()
            .map(|(name, content)| (name.as_str(), content.as_slice()))
            .collect()
    };
    let src = home_dir(&as_refs(0..5000));
    let double = Double::new(Arc::new(MemoryBackend::default()));
    let store = Store::new(double.clone());
    let index_dir = tempdir();
    let mut options = push_options();
    options.index_path = Some(index_dir.path().join("index"));
    let (acme, alice) = (org("acme"), home("alice"));

    let check = |expected_objects: usize, expected_blocks: u64| {
        std::thread::sleep(PAST_RACY_WINDOW);
        double.arm(Faults::default());
        let report = store::push::push(&store, &acme, &alice, src.path(), &options, &NoProgress)
            .expect("push");
        // A store of packs answers each check from its index, listed
        // afresh once per check: no request to the backend names objects.
        let batches = double.exists_batches();
        assert!(
            batches.iter().all(|&n| n <= MISSING_CHECK_BATCH_MAX),
            "a batch over {MISSING_CHECK_BATCH_MAX}: {batches:?}"
        );
        assert_eq!(double.pack_listings(), report.missing_checks);
        assert!(
            report.missing_checks as usize >= expected_objects.div_ceil(MISSING_CHECK_BATCH_MAX),
            "one check for everything: {report:?}"
        );
        assert_eq!(report.blocks_uploaded, expected_blocks);
    };
    // First push, pruned walk: the root, then its 5000 blocks.
    check(1 + 5000, 5000);
    // Incremental: the new root and the 5000 new blocks only.
    write_files(src.path(), &as_refs(5000..10_000));
    check(1 + 5000, 5000);
    assert_verify_ok(&store);
}

/// Uploads go in a few bounded batches, not one call per object, and
/// every batch keeps children before the trees that name them (the block
/// service's rule, enforced by the `Double` here): a first push of many
/// small files in wide and deep directories, then an incremental push of
/// 1% of them changed.
#[test]
fn push_uploads_in_few_batches_children_first() {
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for a in 0..8 {
        for b in 0..10 {
            for f in 0..15 {
                let path = format!("a{a}/b{b}/f{f}.txt");
                files.push((path.clone(), format!("{path} v1\n").into_bytes()));
            }
        }
    }
    files.push(("deep/1/2/3/4/5/6/leaf.txt".to_owned(), b"leaf\n".to_vec()));
    let src = home_dir(
        &files
            .iter()
            .map(|(name, content)| (name.as_str(), content.as_slice()))
            .collect::<Vec<_>>(),
    );
    let double = Double::new(Arc::new(MemoryBackend::default()));
    let store = Store::new(double.clone());
    let index_dir = tempdir();
    let mut options = push_options();
    options.index_path = Some(index_dir.path().join("index"));
    let (acme, alice) = (org("acme"), home("alice"));

    let push_counting = || {
        std::thread::sleep(PAST_RACY_WINDOW);
        double.arm(Faults {
            refuse_incomplete_trees: true,
            ..Faults::default()
        });
        let report = crate::support::on_two_threads(|| {
            store::push::push(&store, &acme, &alice, src.path(), &options, &NoProgress)
        })
        .expect("push");
        (report, double.packs_written())
    };
    let (first, batches) = push_counting();
    let objects = first.blocks_uploaded + first.trees_uploaded;
    assert_eq!(first.blocks_uploaded, files.len() as u64);
    assert_eq!(batches.iter().sum::<usize>() as u64, objects, "{batches:?}");
    assert!(
        batches.len() <= 10,
        "{} batches for {objects} objects: {batches:?}",
        batches.len()
    );

    // 1% of the files change (one per leaf directory, every eighth).
    for (path, content) in files.iter_mut().step_by(15 * 8) {
        *content = format!("{path} v2\n").into_bytes();
        write_files(src.path(), &[(path.as_str(), content.as_slice())]);
    }
    let (second, batches) = push_counting();
    assert_eq!(second.blocks_uploaded, 11);
    assert_eq!(
        batches.iter().sum::<usize>() as u64,
        second.blocks_uploaded + second.trees_uploaded,
        "{batches:?}"
    );
    assert!(batches.len() <= 3, "{batches:?}");
    assert_present_trees_are_complete(&store);
    assert_verify_ok(&store);
    let dest = tempdir();
    pull(&store, &acme, &alice, dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));
}

// ---------------------------------------------------------------------------
// GC racing a push

/// Bug class: "a block reported present by the missing-check is collected
/// before the push commits". Home a's old content is unreferenced once a
/// moves on; home b then pushes that same content, and a gc with no grace
/// runs between b's upload and its commit, deleting what b found present.
/// The push must fail with `CommitRaced` (pointer untouched) and a retry
/// must succeed; in the end b's pointer names a complete tree.
#[test]
fn push_raced_by_gc_between_upload_and_commit_fails_and_retries() {
    // same_trees: b's files also have a's old mtimes, so b's trees are a's
    // old trees (found present), not only its blocks. incremental: b's
    // index names b's current root, so the incremental path decides.
    for (same_trees, incremental) in [(true, false), (false, false), (true, true), (false, true)] {
        check_push_raced_by_gc(same_trees, incremental);
    }
}

fn check_push_raced_by_gc(same_trees: bool, incremental: bool) {
    let case = format!("same_trees={same_trees} incremental={incremental}");
    let store_dir = tempdir();
    let backend: Arc<dyn Backend> =
        Arc::new(LocalBackend::open(store_dir.path()).expect("open local store"));
    let store = Store::new(Arc::clone(&backend));
    let (acme, a, b) = (org("acme"), home("a"), home("b"));
    let old = fixed_home(OLD);
    let new = fixed_home(NEW);
    push(&store, &acme, &a, old.path()).expect("push a (old)");
    push(&store, &acme, &a, new.path()).expect("push a (new)");

    let b_dir = tempdir();
    let index_dir = tempdir();
    let mut options = push_options();
    options.index_path = Some(index_dir.path().join("index"));
    if incremental {
        write_files(b_dir.path(), &[("own.txt", b"b's own first content\n")]);
        store::push::push(&store, &acme, &b, b_dir.path(), &options, &NoProgress)
            .expect("first push of b");
        fs::remove_file(b_dir.path().join("own.txt")).expect("remove");
    }
    write_files(b_dir.path(), OLD);
    if same_trees {
        fix_mtimes(b_dir.path());
    }
    let b_before = store.read_home(&acme, &b).expect("read b");

    let gc_reports = Arc::new(Mutex::new(Vec::new()));
    let hook_store = Store::new(Arc::clone(&backend));
    let reports = Arc::clone(&gc_reports);
    options.before_commit = Some(Box::new(move || {
        let report = gc::gc(&hook_store, Duration::ZERO).expect("gc between upload and commit");
        lock(&reports).push(report);
    }));
    let raced = store::push::push(&store, &acme, &b, b_dir.path(), &options, &NoProgress);
    let deleted = lock(&gc_reports).first().expect("the hook ran").deleted;
    assert!(deleted > 0, "{case}: gc deleted nothing, no race happened");
    match raced {
        Ok(_) => {}
        Err(Error::CommitRaced) => {
            assert_eq!(
                store.read_home(&acme, &b).expect("read b"),
                b_before,
                "{case}: a raced push moved the pointer"
            );
            options.before_commit = None;
            store::push::push(&store, &acme, &b, b_dir.path(), &options, &NoProgress)
                .unwrap_or_else(|err| panic!("{case}: retry after CommitRaced failed: {err}"));
        }
        Err(other) => panic!("{case}: expected CommitRaced, got {other}"),
    }
    assert_verify_ok(&store);
    assert_present_trees_are_complete(&store);
    let dest = tempdir();
    pull(&store, &acme, &b, dest.path()).expect("pull b");
    assert_eq!(contents(dest.path()), contents(b_dir.path()), "{case}");
    assert_eq!(
        contents(dest.path()),
        contents(old.path()),
        "{case}: b holds a's old content"
    );
}

/// Regression (gc.rs): gc read the home pointers a last time and then
/// swept; a push that found an object present, re-checked it and committed
/// inside that window (the whole sweep, minutes on S3) had its object
/// deleted after its commit, leaving its pointer naming a broken tree.
/// Now a push commits only under the store's commit lock, which a sweeping
/// gc excludes: here b pushes a's old (unreferenced) content while gc is
/// about to make its first delete, and must wait, repair and commit a
/// complete tree.
#[test]
fn regression_gc_sweep_robs_a_push_committed_after_its_last_pointer_read() {
    let inner: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let double = Double::new(Arc::clone(&inner));
    let store = Store::new(double.clone());
    let (acme, a) = (org("acme"), home("a"));
    let old = fixed_home(OLD);
    let new = fixed_home(NEW);
    push(&store, &acme, &a, old.path()).expect("push a (old)");
    push(&store, &acme, &a, new.path()).expect("push a (new)");
    let b_dir = fixed_home(OLD);

    let pusher = Arc::new(Mutex::new(None));
    let pusher_slot = Arc::clone(&pusher);
    let hook_store = Store::new(Arc::clone(&inner));
    let b_path = b_dir.path().to_owned();
    double.before_first_delete(move || {
        // gc's rayon workers wait in `delete`: the push gets its own pool.
        let thread = std::thread::spawn(move || {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .expect("thread pool");
            pool.install(|| push(&hook_store, &org("acme"), &home("b"), &b_path))
        });
        // Let the push find a's old objects present and reach its commit.
        std::thread::sleep(Duration::from_millis(500));
        *lock(&pusher_slot) = Some(thread);
    });
    let report = gc::gc(&store, Duration::ZERO).expect("gc");
    assert!(report.deleted > 0);
    let outcome = lock(&pusher)
        .take()
        .expect("the push ran during the sweep")
        .join()
        .expect("push thread");
    outcome.expect("the push waits for gc, repairs and commits");
    assert_verify_ok(&store);
    let dest = tempdir();
    pull(&store, &acme, &home("b"), dest.path()).expect("pull b");
    assert_eq!(contents(dest.path()), contents(b_dir.path()));
}

/// Regression (push.rs, a cleanup on `CommitRaced`, since removed): a push
/// that lost a race deleted the trees it uploaded, but content-addressed
/// objects are shared:
/// another push may have found those trees present and committed a pointer
/// to them meanwhile, and is left naming deleted trees.
///
/// Interleaving (all real operations): gc lists the store and condemns a's
/// old objects; push 1 (home b: a's old `src` plus a new dir `n`) relies on
/// the old `src` tree, uploads `n` and its root, and waits before its
/// commit; gc sweeps `src`; push 2 (home c: the same `n` dir) finds `n`
/// present and commits; push 1 re-checks, gets `CommitRaced` and deletes
/// `n`, which c names.
#[test]
fn regression_commit_raced_cleanup_deletes_trees_another_push_committed() {
    use std::sync::mpsc;

    let inner: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let double = Double::new(Arc::clone(&inner));
    let store = Store::new(double.clone());
    let (acme, a, b, c) = (org("acme"), home("a"), home("b"), home("c"));
    let old = fixed_home(OLD);
    let new = fixed_home(NEW);
    push(&store, &acme, &a, old.path()).expect("push a (old)");
    push(&store, &acme, &a, new.path()).expect("push a (new)");
    let mut b_files = OLD.to_vec();
    b_files.push(("n/new.txt", b"new in b and c"));
    let b_dir = fixed_home(&b_files);
    let c_dir = fixed_home(&[("n/new.txt", b"new in b and c")]);

    let (at_commit_tx, at_commit_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    let first_push = Arc::new(Mutex::new(None));
    let first_push_slot = Arc::clone(&first_push);
    let b_store = Store::new(Arc::clone(&inner));
    let b_path = b_dir.path().to_owned();
    double.before_first_delete(move || {
        let thread = std::thread::spawn(move || {
            let mut options = push_options();
            options.before_commit = Some(Box::new(move || {
                at_commit_tx.send(()).expect("signal");
                lock(&go_rx).recv().expect("wait for go");
            }));
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .expect("thread pool");
            pool.install(|| {
                store::push::push(
                    &b_store,
                    &org("acme"),
                    &home("b"),
                    &b_path,
                    &options,
                    &NoProgress,
                )
            })
        });
        at_commit_rx.recv().expect("push 1 reaches its commit");
        *lock(&first_push_slot) = Some(thread);
    });
    let report = gc::gc(&store, Duration::ZERO).expect("gc");
    assert!(report.deleted > 0);

    push(&store, &acme, &c, c_dir.path()).expect("push 2 (home c)");
    go_tx.send(()).expect("let push 1 commit");
    let first = lock(&first_push)
        .take()
        .expect("push 1 started")
        .join()
        .expect("push 1 thread");
    match first {
        Ok(_) => {}
        Err(Error::CommitRaced) => assert_eq!(store.read_home(&acme, &b).expect("read"), None),
        Err(other) => panic!("push 1: unexpected error {other}"),
    }
    assert_verify_ok(&store);
    let dest = tempdir();
    pull(&store, &acme, &c, dest.path()).expect("pull c");
    assert_eq!(contents(dest.path()), contents(c_dir.path()));
}

// ---------------------------------------------------------------------------
// GC: what it keeps, what it deletes, and when it refuses

/// A store where home a moved from OLD to NEW (so a's old objects are old
/// and unreferenced) and, written after the memory backend's clock moved
/// two hours ahead, home c did the same (so c's old objects are young).
struct History {
    inner: Arc<MemoryBackend>,
    double: Arc<Double>,
    store: Store,
    a_old: Digest,
    c_old: Digest,
}

/// Source dirs of a history, written once and pushed into many stores.
struct Sources {
    old: tempfile::TempDir,
    new: tempfile::TempDir,
    c_old: tempfile::TempDir,
    c_new: tempfile::TempDir,
    b: tempfile::TempDir,
}

impl Sources {
    fn new() -> Sources {
        Sources {
            old: fixed_home(OLD),
            new: fixed_home(NEW),
            c_old: fixed_home(&[("c/one.txt", b"c one"), ("c/sub/two.txt", b"c two")]),
            c_new: fixed_home(&[("c/one.txt", b"c one, edited")]),
            // Shares docs/guide (the same tree) with a's old and new roots.
            b: fixed_home(&[
                (
                    "docs/guide/intro.md",
                    b"# intro\nshared by several versions\n",
                ),
                ("b.txt", b"b"),
            ]),
        }
    }

    fn history(&self) -> History {
        let inner = Arc::new(MemoryBackend::default());
        let double = Double::new(Arc::clone(&inner) as Arc<dyn Backend>);
        let store = Store::new(double.clone());
        let acme = org("acme");
        let a_old = push(&store, &acme, &home("a"), self.old.path())
            .expect("push")
            .root
            .expect("root");
        push(&store, &acme, &home("a"), self.new.path()).expect("push");
        push(&store, &acme, &home("b"), self.b.path()).expect("push");
        inner.advance_clock(Duration::from_secs(2 * 3600));
        let c_old = push(&store, &acme, &home("c"), self.c_old.path())
            .expect("push")
            .root
            .expect("root");
        push(&store, &acme, &home("c"), self.c_new.path()).expect("push");
        History {
            inner,
            double,
            store,
            a_old,
            c_old,
        }
    }
}

impl History {
    fn referenced(&self) -> HashSet<ObjectId> {
        let acme = org("acme");
        ["a", "b", "c"]
            .into_iter()
            .flat_map(|h| reachable(&self.store, &acme, root_of(&self.store, &acme, &home(h))))
            .collect()
    }

    fn present(&self, objects: &HashSet<ObjectId>) -> HashSet<ObjectId> {
        let all: Vec<ObjectId> = objects.iter().copied().collect();
        let missing: HashSet<ObjectId> = self
            .store
            .missing(&org("acme"), &all)
            .expect("missing-check")
            .into_iter()
            .collect();
        all.into_iter().filter(|o| !missing.contains(o)).collect()
    }
}

/// A long grace keeps young unreferenced objects; no grace deletes the old
/// ones (while objects younger than even that stay); referenced objects
/// are kept whatever the grace, and verify stays clean.
#[test]
fn gc_grace_keeps_young_unreferenced_objects_and_never_referenced_ones() {
    let sources = Sources::new();
    let history = sources.history();
    let acme = org("acme");
    let referenced = history.referenced();
    let a_old_only: HashSet<ObjectId> = reachable(&history.store, &acme, history.a_old)
        .difference(&referenced)
        .copied()
        .collect();
    let c_old_only: HashSet<ObjectId> = reachable(&history.store, &acme, history.c_old)
        .difference(&referenced)
        .copied()
        .collect();
    assert!(!a_old_only.is_empty() && !c_old_only.is_empty());
    let everything = object_keys(history.inner.as_ref());

    let report = gc::gc(&history.store, gc::DEFAULT_GRACE).expect("gc with a long grace");
    assert_eq!(report.deleted, 0);
    // Young trees are marked with what they reach, so nothing is condemned.
    assert_eq!(report.marked + report.kept_young, report.objects);
    assert_eq!(object_keys(history.inner.as_ref()), everything);
    assert_verify_ok(&history.store);

    let report = gc::gc(&history.store, Duration::ZERO).expect("gc without grace");
    assert_eq!(report.deleted, a_old_only.len() as u64);
    assert!(history.present(&a_old_only).is_empty(), "old garbage kept");
    assert_eq!(
        history.present(&c_old_only),
        c_old_only,
        "young garbage deleted"
    );
    assert_eq!(
        history.present(&referenced),
        referenced,
        "referenced deleted"
    );
    assert_verify_ok(&history.store);
    for (h, src) in [
        ("a", &sources.new),
        ("b", &sources.b),
        ("c", &sources.c_new),
    ] {
        let dest = tempdir();
        pull(&history.store, &acme, &home(h), dest.path()).expect("pull");
        assert_eq!(snapshot(dest.path()), snapshot(src.path()), "home {h}");
    }
}

/// A present tree implies its whole subtree, after a gc that deleted
/// things and after a gc that died after any number of deletes (parents go
/// before children, trees before blocks).
#[test]
fn gc_keeps_every_present_tree_complete_even_when_interrupted() {
    let sources = Sources::new();
    let full = sources.history();
    let report = gc::gc(&full.store, Duration::ZERO).expect("gc");
    assert!(report.deleted > 0);
    assert_present_trees_are_complete(&full.store);
    assert_verify_ok(&full.store);

    for deletes in 0..report.deleted {
        let history = sources.history();
        history.double.arm(Faults {
            fail_delete_after: Some(deletes),
            ..Faults::default()
        });
        let outcome = gc::gc(&history.store, Duration::ZERO);
        assert!(
            matches!(outcome, Err(Error::GcAborted(_))),
            "gc dying after {deletes} deletes: {outcome:?}"
        );
        assert_present_trees_are_complete(&history.store);
        assert_verify_ok(&history.store);
        history.double.arm(Faults::default());
        gc::gc(&history.store, Duration::ZERO).expect("the next gc finishes");
        assert_eq!(
            object_keys(history.inner.as_ref()),
            object_keys(full.inner.as_ref()),
            "the next gc converges after dying after {deletes} deletes"
        );
    }
}

fn key_of_tree(digest: Digest) -> String {
    Store::object_key(&org("acme"), &ObjectId::tree(digest))
}

/// Where a gc fault is injected.
#[derive(Clone, Copy, Debug)]
enum FaultAt {
    FirstListing,
    ListingAgainBeforeSweep,
    HomePointer,
    HomePointerAgainBeforeSweep,
    ReferencedSubtree,
    YoungUnreferencedTree,
    OldUnreferencedTree,
}

impl FaultAt {
    fn faults(self, history: &History) -> Faults {
        let acme = org("acme");
        let get = |key: String, nth: u64| Faults {
            fail_get: Some((key, nth)),
            ..Faults::default()
        };
        let list = |nth: u64| Faults {
            fail_list_call: Some(nth),
            ..Faults::default()
        };
        let a_pointer = Store::home_key(&acme, &home("a"));
        match self {
            FaultAt::FirstListing => list(1),
            FaultAt::ListingAgainBeforeSweep => list(2),
            FaultAt::HomePointer => get(a_pointer, 1),
            FaultAt::HomePointerAgainBeforeSweep => get(a_pointer, 2),
            FaultAt::ReferencedSubtree => {
                let root = root_of(&history.store, &acme, &home("a"));
                get(key_of_tree(subtree(&history.store, &acme, root, "src")), 1)
            }
            FaultAt::YoungUnreferencedTree => get(key_of_tree(history.c_old), 1),
            FaultAt::OldUnreferencedTree => get(key_of_tree(history.a_old), 1),
        }
    }
}

/// Runs gc on a fresh history with a fault injected at `at` and checks it
/// aborted with the injected error, deleting nothing.
fn check_gc_aborts(sources: &Sources, at: FaultAt) {
    let history = sources.history();
    let faults = at.faults(&history);
    let before = object_keys(history.inner.as_ref());
    history.double.arm(faults);
    match gc::gc(&history.store, Duration::ZERO) {
        Err(Error::GcAborted(inner)) => assert!(
            inner.to_string().contains("injected fault"),
            "{at:?}: aborted for another reason: {inner}"
        ),
        other => panic!("{at:?}: expected GcAborted, got {other:?}"),
    }
    assert_eq!(
        object_keys(history.inner.as_ref()),
        before,
        "{at:?}: gc deleted objects"
    );
}

/// Any listing or read error aborts gc before it deletes anything: an
/// error is never taken for "no objects" or "no references".
#[test]
fn gc_aborts_without_deleting_on_any_listing_or_read_error() {
    let sources = Sources::new();
    for at in [
        FaultAt::FirstListing,
        FaultAt::ListingAgainBeforeSweep,
        FaultAt::HomePointer,
        FaultAt::HomePointerAgainBeforeSweep,
        FaultAt::ReferencedSubtree,
        FaultAt::YoungUnreferencedTree,
    ] {
        check_gc_aborts(&sources, at);
    }
}

/// BUG (gc.rs `condemned_heights`): reading an unreferenced tree to order
/// the sweep swallows errors (`.ok()`): a transient read error makes gc
/// carry on and delete, against "any read error aborts gc before it
/// deletes anything".
#[test]

fn regression_gc_aborts_on_a_read_error_of_an_unreferenced_tree() {
    check_gc_aborts(&Sources::new(), FaultAt::OldUnreferencedTree);
}

/// BUG (gc.rs `condemned_heights`): an unreadable (corrupt) unreferenced
/// tree gets height `u32::MAX`, and its unreferenced parent `MAX + 1`: an
/// overflow panic in debug builds, and in release a wrap to 0 that deletes
/// the parent after its child. gc must not panic on bad store content.
#[test]

fn regression_gc_survives_a_corrupt_unreferenced_subtree() {
    let store = memory_store();
    let (acme, a) = (org("acme"), home("a"));
    let old = fixed_home(OLD);
    let new = fixed_home(NEW);
    let a_old = push(&store, &acme, &a, old.path())
        .expect("push")
        .root
        .expect("root");
    push(&store, &acme, &a, new.path()).expect("push");
    // Unreferenced: a's new src/util has no deep/, so its tree differs.
    let util = subtree(&store, &acme, a_old, "src/util");
    store
        .backend()
        .put(&key_of_tree(util), b"\0not the tree it claims to be")
        .expect("corrupt");
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        gc::gc(&store, Duration::ZERO)
    }))
    .unwrap_or_else(|_| panic!("gc panicked on a corrupt unreferenced tree"));
    assert!(
        matches!(outcome, Ok(_) | Err(Error::GcAborted(_))),
        "{outcome:?}"
    );
    assert_verify_ok(&store);
    if outcome.is_ok() {
        assert_present_trees_are_complete(&store);
    }
}

// ---------------------------------------------------------------------------
// Orgs, corruption

/// An object pushed under one org is invisible to every other org, and gc
/// marks per org: another org's copy of the same content is collected
/// while the first org's stays.
#[test]
fn orgs_are_isolated() {
    let store = memory_store();
    let (acme, other) = (org("acme"), org("other"));
    let src = fixed_home(OLD);
    let root = push(&store, &acme, &home("alice"), src.path())
        .expect("push")
        .root
        .expect("root");
    let objects: Vec<ObjectId> = reachable(&store, &acme, root).into_iter().collect();
    assert!(store.missing(&acme, &objects).expect("check").is_empty());

    let mut missing = store.missing(&other, &objects).expect("check");
    missing.sort();
    let mut all = objects.clone();
    all.sort();
    assert_eq!(missing, all, "another org sees acme's objects");
    for object in &objects {
        assert!(
            matches!(
                store.get_object(&other, object),
                Err(Error::MissingObject { .. })
            ),
            "{object:?} readable from another org"
        );
    }
    assert_eq!(store.read_home(&other, &home("alice")).expect("read"), None);
    let dest = tempdir();
    assert!(matches!(
        pull(&store, &other, &home("alice"), dest.path()),
        Err(Error::NoSuchHome { .. })
    ));

    // The other org stores its own copy, then drops it.
    push(&store, &other, &home("bob"), src.path()).expect("push other");
    push(&store, &other, &home("bob"), fixed_home(NEW).path()).expect("push other");
    gc::gc(&store, Duration::ZERO).expect("gc");
    assert!(store.missing(&acme, &objects).expect("check").is_empty());
    assert!(
        store
            .missing(&other, &[ObjectId::tree(root)])
            .expect("check")
            .contains(&ObjectId::tree(root)),
        "other's unreferenced copy survived"
    );
    assert_verify_ok(&store);
}

/// A stored object whose bytes changed is never served: pull fails with
/// `Corrupt` naming the path (and writes nothing in its place), verify
/// reports it with the path.
#[test]
fn corrupt_objects_fail_pull_and_verify_naming_the_path() {
    let big = vec![b'z'; 10_000];
    let files: &[(&str, &[u8])] = &[
        ("docs/readme.txt", b"a small plain block"),
        ("docs/big.txt", &big),
        ("top.txt", b"top"),
    ];
    let src = home_dir(files);
    // (what is corrupted, the path it must be reported at)
    for (target, path) in [
        ("block", "docs/readme.txt"),
        ("block", "docs/big.txt"),
        ("tree", "docs"),
    ] {
        let store_dir = tempdir();
        let store = Store::new(Arc::new(
            LocalBackend::open(store_dir.path()).expect("open local store"),
        ));
        let (acme, alice) = (org("acme"), home("alice"));
        let root = push(&store, &acme, &alice, src.path())
            .expect("push")
            .root
            .expect("root");
        let object = if target == "tree" {
            ObjectId::tree(subtree(&store, &acme, root, path))
        } else {
            let blocks = file_blocks(&store, &acme, root, path);
            ObjectId::block(blocks[0])
        };
        corrupt_stored(&store, &acme, &object);

        let dest = tempdir();
        match pull(&store, &acme, &alice, dest.path()) {
            Err(err @ Error::Corrupt { .. }) => {
                let Error::Corrupt { path: at, .. } = &err else {
                    unreachable!()
                };
                assert_eq!(at.as_deref(), Some(Path::new(path)), "{err}");
                assert!(err.to_string().contains(path), "{err}");
            }
            other => panic!("{path}: expected Corrupt, got {other:?}"),
        }
        if target == "block" {
            assert!(
                !dest.path().join(path).exists(),
                "{path}: corrupt content was written"
            );
        }
        let leftovers: Vec<PathBuf> = snapshot(dest.path())
            .into_keys()
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.as_encoded_bytes().starts_with(b".roost-tmp"))
            })
            .collect();
        assert!(
            leftovers.is_empty(),
            "{path}: temp files left: {leftovers:?}"
        );

        let report = gc::verify(&store).expect("verify runs");
        assert!(!report.ok(), "{path}: verify saw nothing");
        assert!(
            report.errors.iter().any(|e| e.contains(path)),
            "{path}: {:?}",
            report.errors
        );
    }
}

// ---------------------------------------------------------------------------
// The S3 backend under the engine

/// Push, pull, verify and gc against the real S3-compatible server.
#[test]
fn s3_store_pushes_pulls_and_collects() {
    let store = Store::new(crate::backend::s3_backend("engine"));
    let (acme, alice) = (org("acme"), home("alice"));
    let old = fixed_home(OLD);
    let new = fixed_home(NEW);
    let old_root = push(&store, &acme, &alice, old.path())
        .expect("push old")
        .root
        .expect("root");
    push(&store, &acme, &alice, new.path()).expect("push new");
    let dest = tempdir();
    pull(&store, &acme, &alice, dest.path()).expect("pull");
    assert_eq!(snapshot(dest.path()), snapshot(new.path()));
    assert_verify_ok(&store);

    let report = gc::gc(&store, Duration::ZERO).expect("gc");
    assert!(report.deleted > 0);
    assert!(
        store
            .missing(&acme, &[ObjectId::tree(old_root)])
            .expect("check")
            .contains(&ObjectId::tree(old_root))
    );
    assert_present_trees_are_complete(&store);
    assert_verify_ok(&store);
    let again = tempdir();
    pull(&store, &acme, &alice, again.path()).expect("pull after gc");
    assert_eq!(snapshot(again.path()), snapshot(new.path()));
}

/// Set in the child run of a test re-executed without root privileges.
const UNPRIVILEGED_ENV: &str = "ROOST_IT_UNPRIVILEGED";

/// Root ignores directory permissions; a test about them re-runs itself as
/// `nobody` (through `setpriv`) when the suite runs as root. Returns true
/// when it did, and the caller should return.
fn rerun_unprivileged_if_root(test: &str) -> bool {
    let uid = fs::metadata("/proc/self").expect("stat /proc/self").uid();
    if uid != 0 || std::env::var_os(UNPRIVILEGED_ENV).is_some() {
        return false;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let output = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&exe)
        .args(["--exact", test, "--include-ignored", "--test-threads=1"])
        .env(UNPRIVILEGED_ENV, "1")
        .env("TMPDIR", "/tmp")
        .output()
        .expect("run setpriv (util-linux) to drop root for this test");
    assert!(
        output.status.success(),
        "{test} as nobody failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    true
}

/// BUG (pull.rs): pulling over a previous pull fails with "permission
/// denied" when the home has read-only directories (Go's module cache
/// makes every directory 0555): pull creates, replaces and removes entries
/// inside the existing directory without making it writable first.
#[test]

fn regression_pull_updates_read_only_directories_in_place() {
    if rerun_unprivileged_if_root("engine::regression_pull_updates_read_only_directories_in_place")
    {
        return;
    }
    let make = |files: &[(&str, &[u8])]| {
        let dir = home_dir(files);
        fs::set_permissions(dir.path().join("mod"), fs::Permissions::from_mode(0o555))
            .expect("chmod");
        dir
    };
    let v1 = make(&[("mod/a.go", b"package a // v1"), ("mod/gone.go", b"gone")]);
    let v2 = make(&[("mod/a.go", b"package a // v2"), ("mod/new.go", b"new")]);
    let store = memory_store();
    let (acme, alice) = (org("acme"), home("alice"));
    let dest = tempdir();
    push(&store, &acme, &alice, v1.path()).expect("push v1");
    pull(&store, &acme, &alice, dest.path()).expect("pull v1");
    push(&store, &acme, &alice, v2.path()).expect("push v2");
    let outcome = pull(&store, &acme, &alice, dest.path());
    // Let the temp dirs be removed whatever happened.
    for dir in [v1.path(), v2.path(), dest.path()] {
        let _ = fs::set_permissions(dir.join("mod"), fs::Permissions::from_mode(0o755));
    }
    outcome.expect("pull v2 over v1");
    assert_eq!(contents(dest.path()), contents(v2.path()));
}

/// A home read through snapshots sees every snapshot on its own device
/// number: with the key rule's fixed `dev`, one index serves them all and
/// an unchanged file is never hashed again; without it, every file is.
#[test]
fn upload_tree_index_keys_follow_the_key_rule() {
    let store = memory_store();
    let org = org("acme");
    let dir = fixed_home(&[("a", b"one"), ("sub/b", b"two"), ("sub/c", b"three")]);
    // Past the racy-timestamp window of the files' ctime, so the index may
    // keep them.
    std::thread::sleep(Duration::from_millis(250));
    let state = tempdir();
    let options = |dev: Option<u64>| store::push::UploadOptions {
        excludes: store::excludes::Excludes::none(),
        index_path: Some(state.path().join("index")),
        key_rule: store::index::KeyRule {
            dev,
            observed_at_ns: None,
        },
        since: None,
    };
    let upload = |dev| {
        store::push::upload_tree(
            &store,
            &org,
            dir.path(),
            &options(dev),
            &store::progress::NoProgress,
        )
        .and_then(store::push::Upload::finish)
        .expect("upload")
    };
    let first = upload(Some(0));
    assert_eq!(first.files_hashed, 3);
    assert!(first.blocks_uploaded >= 3);
    let again = upload(Some(0));
    assert_eq!((again.files_hashed, again.blocks_uploaded), (0, 0));
    assert_eq!(again.root, first.root);
    // The index was keyed with device 0: the real device number misses it.
    assert_eq!(upload(None).files_hashed, 3);
}

/// From a store a round trip away (the block service), a directory's
/// subtrees and its small files' blocks come in a few batches; large
/// files' blocks one by one; blocks the cache holds not at all.
#[test]
fn a_store_that_reads_in_batches_fetches_a_directory_in_few_requests() {
    const KIB: usize = 1024;
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    // 1,500 small files in one directory: more than one window (1,024 objects).
    for i in 0..1500 {
        files.push((format!("many/f{i}"), format!("small file {i}").into_bytes()));
    }
    // Ten subdirectories of three files each.
    for d in 0..10 {
        for f in 0..3 {
            files.push((format!("sub/d{d}/f{f}"), format!("{d}/{f}").into_bytes()));
        }
    }
    // A file over the prefetch bound: its one block comes alone.
    files.push(("big".to_owned(), vec![7u8; 2 * 1024 * KIB]));
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(path, content)| (path.as_str(), content.as_slice()))
        .collect();
    let src = home_dir(&refs);
    let double = Double::batching(Arc::new(MemoryBackend::default()));
    let store = Store::new(double.clone());
    let (acme, alice) = (org("acme"), home("alice"));
    // Two uploading threads, whatever the machine: how the blocks are
    // shared out into packs (and so the pull's reads) depends on it.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("thread pool");
    pool.install(|| push(&store, &acme, &alice, src.path()))
        .expect("push");

    let cache = tempdir();
    let mut options = crate::support::pull_options();
    options.cache = Some(cache.path().to_owned());
    double.arm(Faults::default());
    let dest = tempdir();
    let report =
        store::pull::pull(&store, &acme, &alice, dest.path(), &options, &NoProgress).expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));
    let batches = double.get_batches();
    let fetched: usize = batches.iter().sum();
    // The trees, a level at a time (many and sub; d0..d9); then, into
    // an empty directory, the blocks a pack at a time: the small files'
    // (1,530 in one pack) and big's (a pack of its own).
    assert_eq!(batches.len(), 4, "{batches:?}");
    // A batch's ranged reads of a pack also span the objects between
    // those asked for (gaps are cheaper read than split).
    assert!(fetched >= 1500 + 30 + 12, "{fetched} objects in batches");
    // Single reads: the home pointer and the root tree.
    assert_eq!(double.single_gets(), 2);
    assert_eq!(report.blocks_downloaded, 1500 + 30 + 12 + 2);

    // Again into an empty directory: the cache holds every block.
    double.arm(Faults::default());
    let again = tempdir();
    let report = store::pull::pull(&store, &acme, &alice, again.path(), &options, &NoProgress)
        .expect("pull from the cache");
    assert_eq!(contents(again.path()), contents(src.path()));
    assert_eq!(double.get_batches(), Vec::<usize>::new());
    assert_eq!(double.single_gets(), 1, "the home pointer only");
    assert_eq!(report.blocks_downloaded, 0);

    // A cache only read (a home is its own copy) is left as it was.
    let empty_cache = tempdir();
    options.cache = Some(empty_cache.path().to_owned());
    options.fill_cache = false;
    let third = tempdir();
    store::pull::pull(&store, &acme, &alice, third.path(), &options, &NoProgress)
        .expect("pull without filling the cache");
    assert_eq!(contents(third.path()), contents(src.path()));
    assert_eq!(
        fs::read_dir(empty_cache.path()).expect("cache dir").count(),
        0,
        "nothing written to the cache"
    );
}

/// Regression (issue 13, point 6): gc refreshed its lock only while it
/// swept, never while it listed and marked, so a mark that outlasted a
/// lock's life (`LOCK_STALE`, two minutes; a large store on S3) let a push
/// take the gc lock for a dead process's, pass its final existence check,
/// and commit after gc's last listing, onto objects the sweep then
/// deleted: a home naming missing objects.
///
/// Lock lives are shortened here (400 ms, refreshed every 20 ms) and every
/// read gc makes is slow (30 ms, about 1.3 s of marking): the push of b
/// (a's old, condemned content) starts 600 ms in, and its final existence
/// check answers 1.5 s after it looked, landing its pointer after the
/// sweep. With gc's lock kept fresh while it marks, the push waits for the
/// sweep, finds what went, uploads it again and commits a complete home.
#[test]
fn regression_a_long_gc_mark_keeps_its_lock_and_no_push_commits_into_its_sweep() {
    let timing = store::LockTiming {
        stale: Duration::from_millis(400),
        refresh: Duration::from_millis(20),
    };
    let inner: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let gc_double = Double::new(Arc::clone(&inner));
    let gc_store = Store::new(gc_double.clone()).with_lock_timing(timing);
    let (acme, a) = (org("acme"), home("a"));
    let old: Vec<(String, Vec<u8>)> = (0..10)
        .map(|i| (format!("old/d{i}/f"), format!("old {i}\n").into_bytes()))
        .collect();
    let new: Vec<(String, Vec<u8>)> = (0..40)
        .map(|i| (format!("new/d{i}/f"), format!("new {i}\n").into_bytes()))
        .collect();
    let old_dir = fixed_home(&as_files(&old));
    let new_dir = fixed_home(&as_files(&new));
    push(&gc_store, &acme, &a, old_dir.path()).expect("push a (old)");
    push(&gc_store, &acme, &a, new_dir.path()).expect("push a (new)");
    let b_dir = fixed_home(&as_files(&old));

    let push_double = Double::new(Arc::clone(&inner));
    push_double.arm(Faults {
        delay_exists_call: Some((2, Duration::from_millis(1500))),
        ..Faults::default()
    });
    let push_store = Store::new(push_double.clone()).with_lock_timing(timing);
    gc_double.arm(Faults {
        get_delay: Some(Duration::from_millis(30)),
        ..Faults::default()
    });
    let b_path = b_dir.path().to_owned();
    let pusher = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(600));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("thread pool");
        let pushed = pool.install(|| push(&push_store, &org("acme"), &home("b"), &b_path));
        (pushed, push_double.existence_checks())
    });
    let report = gc::gc(&gc_store, Duration::ZERO).expect("gc");
    assert!(
        report.deleted > 0,
        "gc condemned a's old content: {report:?}"
    );
    let (pushed, exists_calls) = pusher.join().expect("push thread");
    pushed.expect("the push waits for gc, uploads again what went, and commits");
    assert!(exists_calls >= 2, "the push checked before committing");

    gc_double.arm(Faults::default());
    let checker = Store::new(Arc::clone(&inner));
    assert_verify_ok(&checker);
    let dest = tempdir();
    pull(&checker, &acme, &home("b"), dest.path()).expect("pull b");
    assert_eq!(contents(dest.path()), contents(b_dir.path()));
}

fn as_files(list: &[(String, Vec<u8>)]) -> Vec<(&str, &[u8])> {
    list.iter()
        .map(|(path, content)| (path.as_str(), content.as_slice()))
        .collect()
}
