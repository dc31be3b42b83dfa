//! Push, in two steps: [`upload_tree`] (scan → ask which objects are
//! missing → upload only those), then [`commit`] (sync → re-verify what
//! the upload relied on → write the home pointer last). [`push`] is the
//! two together, for a process that holds the store. A client of the
//! control plane's block service runs the first step only
//! ([`Upload::finish`]); the server commits ([`commit_uploaded`]).
//!
//! The pointer only ever names a complete tree: it is written after every
//! object it reaches is durable in the store. A push killed at any point
//! leaves the previous pointer intact, and the next push simply finds
//! some of its objects already present.
//!
//! Deciding what is missing:
//! - incremental (the index says this directory was last synced as the
//!   home's current root): everything reachable from that root is present,
//!   so only objects new since then are asked about, in one batched check;
//! - otherwise a top-down walk pruned by tree digests: a tree that is
//!   present has its whole subtree present (an invariant gc keeps by
//!   deleting parents before children and trees before blocks), so an
//!   unchanged subtree costs one id.
//!
//! Uploads go in bounded batches ([`Objects::put_batch`], one request
//! each through the block service): blocks first, then trees level by
//! level, so children are stored before the trees that name them.
//!
//! Objects found present but not referenced by this home's current root
//! may be collected by a concurrent gc before we commit. They are checked
//! again under the store's commit lock, which excludes gc sweeps until the
//! pointer is written (see [`Store::lock_commit`]); whatever vanished is
//! uploaded again first.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::excludes::Excludes;
use crate::index::{FileMap, Index, KeyRule, LastSync, SpilledFiles};
use crate::objects::{Objects, children};
use crate::pack::PackBuilder;
use crate::progress::Progress;
use crate::scan::{self, Scan, TreeNode, with_block};
use crate::store::{MISSING_CHECK_BATCH_MAX, ObjectId, ObjectKind};
use crate::{Digest, Error, HomeName, OrgId, Result, Store};

pub struct PushOptions {
    pub excludes: Excludes,
    /// Where this directory's file index lives; `None` hashes everything.
    pub index_path: Option<PathBuf>,
    /// Identifies the store in the index (its URL).
    pub store_id: String,
    /// Called after uploads, before the commit (tests use it to race gc).
    #[doc(hidden)]
    pub before_commit: Option<Box<dyn Fn() + Sync>>,
}

impl PushOptions {
    pub fn new(store_id: impl Into<String>) -> PushOptions {
        PushOptions {
            excludes: Excludes::default_set(),
            index_path: None,
            store_id: store_id.into(),
            before_commit: None,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PushReport {
    pub root: Option<Digest>,
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub special_skipped: u64,
    pub excluded: u64,
    pub bytes_scanned: u64,
    /// File bytes the tree describes (equals `bytes_scanned`).
    pub logical_bytes: u64,
    pub files_hashed: u64,
    pub bytes_hashed: u64,
    pub blocks_uploaded: u64,
    pub trees_uploaded: u64,
    /// Stored (compressed) bytes sent to the store.
    pub bytes_uploaded: u64,
    pub missing_checks: u64,
    /// True when the home already pointed at this exact tree.
    pub unchanged: bool,
}

/// Uploads `dir` as `home`'s tree and points the home at it: [`upload_tree`]
/// then [`commit`].
pub fn push(
    store: &Store,
    org: &OrgId,
    home: &HomeName,
    dir: &Path,
    options: &PushOptions,
    progress: &dyn Progress,
) -> Result<PushReport> {
    let since = Since {
        store_id: options.store_id.clone(),
        home: home.clone(),
        root: store.read_home(org, home)?,
    };
    let upload_options = UploadOptions {
        excludes: options.excludes.clone(),
        index_path: options.index_path.clone(),
        key_rule: KeyRule::default(),
        since: Some(since),
    };
    let upload = upload_tree(store, org, dir, &upload_options, progress)?;
    if !upload.report.unchanged
        && let Some(hook) = &options.before_commit
    {
        hook();
    }
    commit(store, org, home, upload, progress)
}

/// How [`upload_tree`] reads the directory.
pub struct UploadOptions {
    pub excludes: Excludes,
    /// The directory's file index: read to skip hashing unchanged files,
    /// rewritten by [`Upload::finish`] or [`commit`]. `None` hashes
    /// everything.
    pub index_path: Option<PathBuf>,
    pub key_rule: KeyRule,
    /// The home the tree is for, as it is now, when this process commits
    /// it ([`commit`]). `None`: what is missing is found by walking down
    /// from the root.
    pub since: Option<Since>,
}

impl UploadOptions {
    /// Everything included (no excludes), no index.
    pub fn everything() -> UploadOptions {
        UploadOptions {
            excludes: Excludes::none(),
            index_path: None,
            key_rule: KeyRule::default(),
            since: None,
        }
    }
}

/// A home as an upload for it begins: when the home already points at the
/// scanned tree nothing is uploaded, and when the index's last sync was
/// this home at this root only objects new since then are asked about.
#[derive(Clone, Debug)]
pub struct Since {
    /// Identifies the store in the index (its URL).
    pub store_id: String,
    pub home: HomeName,
    /// What the home points at now.
    pub root: Option<Digest>,
}

/// The first step of a push done: the tree's objects are in the store (not
/// yet necessarily durable), no home points at it yet.
pub struct Upload {
    pub report: PushReport,
    scan: Scan,
    /// Of the index the scan read: its file count and last sync, which
    /// [`commit`] compares with this push. Its files map is dropped once
    /// the missing check has used it, not held through the upload (~13 MB
    /// at 100k files).
    old_index_files: usize,
    old_index_last: Option<LastSync>,
    index_path: Option<PathBuf>,
    since: Option<Since>,
    /// Objects found present rather than uploaded: [`commit`] checks them
    /// again under the store's commit lock.
    relied_on: Vec<ObjectId>,
    /// The scan's file records, set aside on disk through the upload
    /// (then the scan's map is empty); `None`: they are in the scan.
    spilled: Option<SpilledFiles>,
}

/// Uploads whatever of `dir`'s tree the org's store lacks, pointing no
/// home at it: the first step of a push, through a store this process
/// holds or through the block service (whose client cannot take the
/// store's commit lock, so the server commits: [`commit_uploaded`]).
pub fn upload_tree(
    objects: &dyn Objects,
    org: &OrgId,
    dir: &Path,
    options: &UploadOptions,
    progress: &dyn Progress,
) -> Result<Upload> {
    let index = options
        .index_path
        .as_deref()
        .map(Index::load)
        .unwrap_or_default();
    let mut scan = scan::scan(dir, &options.excludes, &index, options.key_rule, progress)?;
    let mut report = report_of(&scan);
    let since = options.since.as_ref();
    let mut relied_on = Vec::new();
    let mut missing = Vec::new();
    if since.is_some_and(|since| since.root == Some(scan.root)) {
        report.unchanged = true;
    } else {
        let last_is_current = since.is_some_and(|since| {
            index.last.as_ref().is_some_and(|last| {
                last.store == since.store_id
                    && last.org == org.as_str()
                    && last.home == since.home.as_str()
                    && Some(last.root) == since.root
            })
        });
        (missing, relied_on) = if last_is_current {
            find_missing_incremental(objects, org, &scan, &index, &mut report)?
        } else {
            find_missing_pruned(objects, org, &scan, &mut report)?
        };
    }
    let old_index_files = index.files.len();
    let Index {
        files: old_files,
        last: old_index_last,
    } = index;
    drop(old_files);
    // The new file records wait on disk for the index they go in: the
    // upload's peak is then its packs over the trees, not these as well.
    let spilled = match &options.index_path {
        Some(path) if !report.unchanged => {
            let spilled = SpilledFiles::write(path, &scan.collected.index_files);
            if spilled.is_some() {
                scan.collected.index_files = FileMap::default();
            }
            spilled
        }
        _ => None,
    };
    // So do the trees, read back as they go up.
    if let Some(dir) = options.index_path.as_deref().and_then(Path::parent)
        && !missing.is_empty()
    {
        scan.collected.set_trees_aside(dir);
    }
    if !report.unchanged {
        upload_missing(objects, org, &scan, &missing, &mut report, progress)?;
    }
    Ok(Upload {
        report,
        scan,
        old_index_files,
        old_index_last,
        index_path: options.index_path.clone(),
        since: options.since.clone(),
        relied_on,
        spilled,
    })
}

impl Upload {
    /// The uploaded tree's root.
    pub fn root(&self) -> Digest {
        self.scan.root
    }

    /// Ends an upload that another party commits (the server, for a client
    /// of the block service): records the directory's files in its index,
    /// with no last sync (no pointer was written here), and returns the
    /// report.
    pub fn finish(self) -> Result<PushReport> {
        if let Some(path) = &self.index_path {
            save_index(path, self.scan.collected.index_files, self.spilled, None)?;
        }
        Ok(self.report)
    }
}

/// Writes the directory's index at `path`: the records set aside during
/// the upload, or the scan's own.
fn save_index(
    path: &Path,
    files: FileMap<Vec<Digest>>,
    spilled: Option<SpilledFiles>,
    last: Option<LastSync>,
) -> Result<()> {
    match spilled {
        Some(spilled) => spilled.save(path, last.as_ref()),
        None => Index { files, last }.save(path),
    }
}

/// What [`commit_uploaded`] found at a root.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TreeSummary {
    /// File bytes of the whole tree (directory entries carry their totals).
    pub logical_bytes: u64,
}

/// Points `home` at `root` once the tree is in the org's store: the
/// server's second step for a tree a client uploaded through the block
/// service ([`upload_tree`]). Trees are accepted only with their children
/// present ([`crate::objects::put_tree_checked`]) and gc removes parents
/// first, so the root's presence proves the whole tree's; the check and
/// the pointer write run under the store's commit lock, so no gc sweeps
/// between them. A root that is absent leaves the pointer as it was:
/// [`Error::IncompleteTree`].
pub fn commit_uploaded(
    store: &Store,
    org: &OrgId,
    home: &HomeName,
    root: &Digest,
) -> Result<TreeSummary> {
    let _lock = store.lock_commit()?;
    let tree = match store.get_tree(org, root) {
        Ok(tree) => tree,
        Err(Error::MissingObject { .. }) => {
            return Err(Error::IncompleteTree {
                root: *root,
                missing: 1,
            });
        }
        Err(err) => return Err(err),
    };
    // A root stored before uploads were checked (or by a push with direct
    // store access, which keeps the same order) still needs its own
    // children: they are what this commit can cheaply confirm.
    let missing = store.missing(org, &children(&tree))?;
    if !missing.is_empty() {
        return Err(Error::IncompleteTree {
            root: *root,
            missing: missing.len() as u64,
        });
    }
    let summary = TreeSummary {
        logical_bytes: crate::tree::logical_bytes(&tree.entries),
    };
    store.sync()?;
    store.write_home(org, home, root)?;
    Ok(summary)
}

fn report_of(scan: &Scan) -> PushReport {
    let n = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    let stats = &scan.stats;
    PushReport {
        root: Some(scan.root),
        files: n(&stats.files),
        dirs: n(&stats.dirs),
        symlinks: n(&stats.symlinks),
        special_skipped: n(&stats.special_skipped),
        excluded: n(&stats.excluded),
        bytes_scanned: n(&stats.bytes_scanned),
        logical_bytes: scan.logical_bytes,
        files_hashed: n(&stats.files_hashed),
        bytes_hashed: n(&stats.bytes_hashed),
        ..PushReport::default()
    }
}

/// Which of `ids` the store lacks, asked a bounded batch
/// ([`MISSING_CHECK_BATCH_MAX`]) per request; each request is counted in
/// the report.
fn missing(
    objects: &dyn Objects,
    org: &OrgId,
    ids: &[ObjectId],
    report: &mut PushReport,
) -> Result<Vec<ObjectId>> {
    let mut missing = Vec::new();
    for batch in ids.chunks(MISSING_CHECK_BATCH_MAX) {
        report.missing_checks += 1;
        missing.extend(objects.missing(org, batch)?);
    }
    Ok(missing)
}

/// Returns (missing objects, objects found present that we rely on).
type MissingAndRelied = (Vec<ObjectId>, Vec<ObjectId>);

fn find_missing_incremental(
    objects: &dyn Objects,
    org: &OrgId,
    scan: &Scan,
    index: &Index,
    report: &mut PushReport,
) -> Result<MissingAndRelied> {
    let mut known: HashSet<Digest> = HashSet::new();
    if let Some(last) = &index.last {
        known.extend(last.trees.iter().copied());
    }
    let known_blocks: HashSet<&Digest> = index.files.values().flatten().collect();
    let mut candidates: Vec<ObjectId> = Vec::new();
    let mut seen_blocks: HashSet<Digest> = HashSet::new();
    for (digest, node) in &scan.collected.trees {
        if known.contains(digest) {
            continue;
        }
        candidates.push(ObjectId::tree(*digest));
        for block in &node.blocks {
            if !known_blocks.contains(block) && seen_blocks.insert(*block) {
                candidates.push(ObjectId::block(*block));
            }
        }
    }
    let missing = missing(objects, org, &candidates, report)?;
    let missing_set: HashSet<ObjectId> = missing.iter().copied().collect();
    let relied_on = candidates
        .into_iter()
        .filter(|c| !missing_set.contains(c))
        .collect();
    Ok((missing, relied_on))
}

fn find_missing_pruned(
    objects: &dyn Objects,
    org: &OrgId,
    scan: &Scan,
    report: &mut PushReport,
) -> Result<MissingAndRelied> {
    let trees = &scan.collected.trees;
    let mut absent_all = Vec::new();
    let mut relied_on = Vec::new();
    let mut seen: HashSet<ObjectId> = HashSet::new();
    let mut level = vec![ObjectId::tree(scan.root)];
    seen.insert(level[0]);
    while !level.is_empty() {
        let absent = missing(objects, org, &level, report)?;
        let absent_set: HashSet<ObjectId> = absent.iter().copied().collect();
        let mut next = Vec::new();
        for object in level {
            if !absent_set.contains(&object) {
                relied_on.push(object);
                continue;
            }
            absent_all.push(object);
            // A missing tree's children must be asked about in turn.
            if let Some(node) = trees
                .get(&object.digest)
                .filter(|_| object.kind == ObjectKind::Tree)
            {
                let children = node
                    .subtrees
                    .iter()
                    .map(|d| ObjectId::tree(*d))
                    .chain(node.blocks.iter().map(|d| ObjectId::block(*d)));
                for child in children {
                    if seen.insert(child) {
                        next.push(child);
                    }
                }
            }
        }
        level = next;
    }
    Ok((absent_all, relied_on))
}

/// Commits rounds before giving up on a store whose gc keeps taking what
/// this push needs.
const COMMIT_ATTEMPTS_MAX: usize = 3;

/// The second step of a push for a process that holds the store: makes
/// the upload durable, re-checks under the store's commit lock what the
/// upload found present but did not upload, and writes the pointer only
/// if all of it is still there. Anything a gc took meanwhile is uploaded
/// again outside the lock (the scan still holds every tree and knows where
/// every block is read from), and the check repeats. Objects are never
/// deleted here: another push may already rely on them. Then the
/// directory's index records this sync, so the next push of it to the
/// same home asks only about what changed.
pub fn commit(
    store: &Store,
    org: &OrgId,
    home: &HomeName,
    upload: Upload,
    progress: &dyn Progress,
) -> Result<PushReport> {
    let Upload {
        mut report,
        scan,
        old_index_files,
        old_index_last,
        index_path,
        since,
        mut relied_on,
        spilled,
    } = upload;
    if !report.unchanged {
        commit_pointer(
            store,
            org,
            home,
            &scan,
            &mut relied_on,
            &mut report,
            progress,
        )?;
    }
    let Some(path) = index_path else {
        free_in_background(scan);
        return Ok(report);
    };
    let store_id = since.map(|since| since.store_id);
    // An unchanged home whose every file came from the index leaves the
    // index as it was: skip rewriting it (the fast path stays fast).
    let index_unchanged = report.unchanged
        && report.files_hashed == 0
        && spilled
            .as_ref()
            .map_or(scan.collected.index_files.len(), SpilledFiles::len)
            == old_index_files
        && old_index_last.as_ref().is_some_and(|last| {
            Some(&last.store) == store_id.as_ref()
                && last.org == org.as_str()
                && last.home == home.as_str()
                && last.root == scan.root
        });
    if !index_unchanged {
        let trees = scan.collected.trees.keys().copied().collect();
        let last = store_id.map(|store| LastSync {
            store,
            org: org.to_string(),
            home: home.to_string(),
            root: scan.root,
            trees,
        });
        save_index(&path, scan.collected.index_files, spilled, last)?;
        free_in_background(scan.collected.trees);
    } else {
        free_in_background(scan);
    }
    Ok(report)
}

/// Frees what a scan collected (a tree and its block list per directory,
/// the file index: hundreds of thousands of allocations at 100k files)
/// on a thread of its own: freeing it took a twentieth of an unchanged
/// re-push, after the push was done. A process that exits meanwhile
/// frees it all at once; where no thread can be made, it is freed here.
fn free_in_background<T: Send + 'static>(collected: T) {
    let _ = std::thread::Builder::new()
        .name("roost-free".to_owned())
        .spawn(move || drop(collected));
}

/// [`commit`]'s rounds: sync, check under the lock, write the pointer, or
/// upload again what vanished.
fn commit_pointer(
    store: &Store,
    org: &OrgId,
    home: &HomeName,
    scan: &Scan,
    relied_on: &mut Vec<ObjectId>,
    report: &mut PushReport,
    progress: &dyn Progress,
) -> Result<()> {
    store.sync()?;
    for _ in 0..COMMIT_ATTEMPTS_MAX {
        let lock = store.lock_commit()?;
        let mut vanished = false;
        for chunk in relied_on.chunks(MISSING_CHECK_BATCH_MAX * 8) {
            if !missing(store, org, chunk, report)?.is_empty() {
                vanished = true;
                break;
            }
            lock.refresh_if_due()?;
        }
        if !vanished {
            return store.write_home(org, home, &scan.root);
        }
        drop(lock);
        tracing::info!("objects this push relied on were collected by gc; uploading them again");
        let everything: Vec<ObjectId> = scan
            .collected
            .trees
            .keys()
            .map(|d| ObjectId::tree(*d))
            .chain(scan.collected.all_blocks().into_iter().map(ObjectId::block))
            .collect();
        let absent = missing(store, org, &everything, report)?;
        let absent_set: HashSet<ObjectId> = absent.iter().copied().collect();
        *relied_on = everything
            .into_iter()
            .filter(|o| !absent_set.contains(o))
            .collect();
        upload_missing(store, org, scan, &absent, report, progress)?;
        store.sync()?;
    }
    Err(Error::CommitRaced)
}

/// Bounds on one upload batch (one [`Objects::put_batch`], which the block
/// service's client sends as one request): the plain bytes a thread reads
/// and holds at once, and the objects. A change of 1% of a grown home
/// (about a thousand blocks, three thousand trees) then goes up in a few
/// dozen requests instead of one per object; at 4 MiB a request's fixed
/// cost is a few percent of its transfer.
pub const UPLOAD_BATCH_BYTES_MAX: u64 = 4 * 1024 * 1024;
pub const UPLOAD_BATCH_OBJECTS_MAX: usize = 1024;

/// Uploads the missing objects: blocks, then trees children first.
fn upload_missing(
    objects: &dyn Objects,
    org: &OrgId,
    scan: &Scan,
    missing: &[ObjectId],
    report: &mut PushReport,
    progress: &dyn Progress,
) -> Result<()> {
    let trees = &scan.collected.trees;
    let (blocks, mut tree_ids): (Vec<ObjectId>, Vec<ObjectId>) =
        missing.iter().partition(|o| o.kind == ObjectKind::Block);
    let mut wanted: Vec<Digest> = blocks.iter().map(|b| b.digest).collect();
    wanted.sort_unstable();
    wanted.dedup();
    let sources = scan.collected.block_sources(&scan.root, &wanted)?;
    if sources.blocks.len() < wanted.len() {
        // A missing block no scanned file holds: nothing can upload it.
        let found: HashSet<Digest> = sources.blocks.iter().map(|at| at.digest).collect();
        if let Some(digest) = wanted.iter().find(|d| !found.contains(d)) {
            return Err(Error::MissingObject {
                digest: *digest,
                path: None,
            });
        }
    }
    drop(wanted);
    drop(blocks);
    let block_sizes: Vec<u64> = sources.blocks.iter().map(|at| at.len).collect();
    progress.phase("uploading", Some(block_sizes.iter().sum()));
    let threads = rayon::current_num_threads();
    let limits = objects.upload_batch_limits();
    let uploaded_bytes = AtomicU64::new(0);
    // A batch is encoded straight into the pack that carries it (sized
    // for its plain bytes, an upper bound of its stored ones), so a
    // thread holds its batch once, not as objects and then as a pack.
    let put = |pack: PackBuilder| -> Result<()> {
        let stored = pack.stored_bytes();
        objects.put_pack(org, pack)?;
        uploaded_bytes.fetch_add(stored, Ordering::Relaxed);
        Ok(())
    };
    let capacity =
        |sizes: &[u64]| sizes.iter().map(|&size| stored_size_max(size)).sum::<u64>() as usize;
    // Blocks name nothing: any batch may go up alongside any other.
    pack_batch_ranges(&block_sizes, threads, limits)
        .into_par_iter()
        .try_for_each(|range| -> Result<()> {
            let mut pack = PackBuilder::with_capacity(capacity(&block_sizes[range.clone()]));
            let mut decoded = None;
            for at in &sources.blocks[range.clone()] {
                let path = sources.path(at, &mut decoded)?;
                with_block(&path, at.offset, at.len, &at.digest, |data| {
                    pack.push_plain(ObjectId::block(at.digest), data);
                    Ok(())
                })?;
            }
            put(pack)?;
            progress.advance(block_sizes[range].iter().sum());
            Ok(())
        })?;
    // Children before parents: a tree is only ever present with its whole
    // subtree, which the pruned missing-check relies on (and the block
    // service refuses a tree whose children it lacks). Height (distance
    // to the deepest leaf) orders them; depth would not, as one subtree
    // can appear at several depths. They go up as one ordered sequence of
    // batches (a batch is stored in order): a store writing packs then
    // holds the home's trees in a few full packs, so a pull reading them
    // a level at a time reads few packs per level, not one per level per
    // thread. Trees are small; encoding a 100k-file home's takes a
    // fraction of a second.
    let heights = tree_heights(trees);
    let height = |t: &ObjectId| heights.get(&t.digest).copied().unwrap_or(0);
    tree_ids.sort_by_key(height);
    let tree_sizes: Vec<u64> = tree_ids
        .iter()
        .map(|t| trees.get(&t.digest).map_or(0, |node| node.len()))
        .collect();
    for range in pack_batch_ranges(&tree_sizes, 1, limits) {
        let mut pack = PackBuilder::with_capacity(capacity(&tree_sizes[range.clone()]));
        for object in &tree_ids[range] {
            let node = trees.get(&object.digest).ok_or(Error::MissingObject {
                digest: object.digest,
                path: None,
            })?;
            pack.push_plain(*object, &scan.collected.tree_bytes(node)?);
        }
        put(pack)?;
    }
    report.blocks_uploaded += sources.blocks.len() as u64;
    report.trees_uploaded += tree_ids.len() as u64;
    report.bytes_uploaded += uploaded_bytes.into_inner();
    Ok(())
}

/// The most bytes an object of `plain` bytes takes once encoded
/// ([`crate::block::encode_into`]): content that does not compress is
/// stored as it is behind a frame byte.
fn stored_size_max(plain: u64) -> u64 {
    plain + 1
}

/// [`batch_ranges`] of objects of the given plain sizes, bounded by what
/// they can take encoded: each batch's pack is then within a pack's
/// bounds and written as it was built. Bounded by plain bytes, a batch of
/// four incompressible 4 MiB blocks came to 4 bytes past a 16 MiB pack
/// and was copied into two new packs, holding it twice.
fn pack_batch_ranges(
    plain_sizes: &[u64],
    parallel: usize,
    limits: (u64, usize),
) -> Vec<std::ops::Range<usize>> {
    let stored: Vec<u64> = plain_sizes
        .iter()
        .map(|&size| stored_size_max(size))
        .collect();
    batch_ranges(&stored, parallel, limits)
}

/// What an object costs beyond its bytes when work is shared out among
/// threads (a file to open, a frame, a store call): small objects count.
const OBJECT_WEIGHT_BYTES: u64 = 512;

/// Splits items of the given sizes into consecutive ranges (batches) of at
/// most `bytes_max` bytes (a larger item alone) and `objects_max` items
/// ([`Objects::upload_batch_limits`]), each at most about a `parallel`th
/// of the work, so that every thread has some.
fn batch_ranges(
    sizes: &[u64],
    parallel: usize,
    (bytes_max, objects_max): (u64, usize),
) -> Vec<std::ops::Range<usize>> {
    let weight = |size: u64| size + OBJECT_WEIGHT_BYTES;
    let total: u64 = sizes.iter().map(|&size| weight(size)).sum();
    let share = total.div_ceil(parallel.max(1) as u64);
    let mut ranges = Vec::new();
    let (mut start, mut bytes, mut weighed) = (0, 0, 0);
    for (i, &size) in sizes.iter().enumerate() {
        if i > start && (bytes + size > bytes_max || i - start == objects_max) {
            ranges.push(start..i);
            (start, bytes, weighed) = (i, 0, 0);
        }
        bytes += size;
        weighed += weight(size);
        if weighed >= share {
            ranges.push(start..i + 1);
            (start, bytes, weighed) = (i + 1, 0, 0);
        }
    }
    if start < sizes.len() {
        ranges.push(start..sizes.len());
    }
    ranges
}

/// Each scanned tree's height (distance to its deepest leaf), without
/// recursion.
fn tree_heights(trees: &HashMap<Digest, TreeNode>) -> HashMap<Digest, u32> {
    crate::tree::fold_bottom_up(
        trees.keys().copied(),
        |digest| {
            trees
                .get(digest)
                .map_or_else(Vec::new, |n| n.subtrees.clone())
        },
        |_, below: &[u32]| below.iter().map(|h| h.saturating_add(1)).max().unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `expected`: each batch as (start, end).
    const LIMITS: (u64, usize) = (UPLOAD_BATCH_BYTES_MAX, UPLOAD_BATCH_OBJECTS_MAX);

    fn check(sizes: &[u64], parallel: usize, expected: &[(usize, usize)]) {
        let ranges: Vec<(usize, usize)> = batch_ranges(sizes, parallel, LIMITS)
            .into_iter()
            .map(|r| (r.start, r.end))
            .collect();
        assert_eq!(ranges, expected, "sizes {sizes:?}");
    }

    #[test]
    fn batches_are_bounded_and_give_every_thread_work() {
        const MIB: u64 = 1024 * 1024;
        check(&[], 2, &[]);
        check(&[10], 2, &[(0, 1)]);
        // Small items: split among the threads.
        check(&[10, 10, 10, 10], 2, &[(0, 2), (2, 4)]);
        check(&[10, 10, 10, 10], 1, &[(0, 4)]);
        check(&[10, 10, 10, 10, 10], 2, &[(0, 3), (3, 5)]);
        check(&[0; 6], 3, &[(0, 2), (2, 4), (4, 6)]);
        // Bytes bound: 4 MiB per batch whatever the thread count; a larger
        // item goes alone.
        check(&[3 * MIB, 3 * MIB, 3 * MIB], 1, &[(0, 1), (1, 2), (2, 3)]);
        check(&[9 * MIB, 1, 1], 1, &[(0, 1), (1, 3)]);
        check(&[1, 1, 9 * MIB], 1, &[(0, 2), (2, 3)]);
        // Count bound.
        let many = vec![1; UPLOAD_BATCH_OBJECTS_MAX * 2 + 1];
        let ranges = batch_ranges(&many, 1, LIMITS);
        assert_eq!(ranges.len(), 3);
        assert!(ranges.iter().all(|r| r.len() <= UPLOAD_BATCH_OBJECTS_MAX));
        // Every item in exactly one batch, in order.
        let sizes: Vec<u64> = (0..5000).map(|i| (i * 7919) % (3 * MIB)).collect();
        for parallel in [1, 2, 3, 16] {
            let ranges = batch_ranges(&sizes, parallel, LIMITS);
            assert!(ranges.len() >= parallel);
            let mut next = 0;
            for range in &ranges {
                assert_eq!(range.start, next);
                assert!(!range.is_empty());
                let bytes: u64 = sizes[range.clone()].iter().sum();
                assert!(bytes <= UPLOAD_BATCH_BYTES_MAX || range.len() == 1);
                next = range.end;
            }
            assert_eq!(next, sizes.len());
        }
    }

    /// A pack built from a batch is one a pack's bounds allow
    /// ([`PackBuilder::within_bounds`]) even when nothing in it
    /// compresses: four 4 MiB blocks of random bytes, batched for a store
    /// writing 16 MiB packs, made a 16 MiB + 4 pack, which was copied
    /// into two new ones (the batch held twice).
    #[test]
    fn a_batch_of_incompressible_blocks_builds_a_pack_within_bounds() {
        const MIB: usize = 1024 * 1024;
        let limits = (crate::pack::PACK_BYTES_MAX, crate::pack::PACK_OBJECTS_MAX);
        let blocks: Vec<Vec<u8>> = (0..8u8)
            .map(|seed| {
                let mut bytes = vec![0u8; 4 * MIB];
                let mut state = u64::from(seed) + 1;
                for byte in &mut bytes {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    *byte = state as u8;
                }
                bytes
            })
            .collect();
        let sizes: Vec<u64> = blocks.iter().map(|b| b.len() as u64).collect();
        let ranges = pack_batch_ranges(&sizes, 1, limits);
        assert!(ranges.len() >= 2, "8 × 4 MiB exceeds one 16 MiB pack");
        for range in ranges {
            let mut pack = PackBuilder::default();
            for block in &blocks[range.clone()] {
                pack.push_plain(ObjectId::block(Digest::of(block)), block);
            }
            assert!(
                pack.within_bounds(),
                "batch {range:?}: {} stored bytes in a pack bounded at {}",
                pack.stored_bytes(),
                crate::pack::PACK_BYTES_MAX
            );
        }
    }

    /// An upload that keeps an index sets its trees aside beside it, and
    /// what goes up is every tree as encoded: each reads back from the
    /// store whole and checked.
    #[test]
    fn an_upload_with_an_index_sends_the_trees_it_set_aside() {
        let home = crate::scan::test_home(30, 1);
        let state = tempfile::tempdir().expect("tempdir");
        let store = Store::open("memory:").expect("store");
        let org: OrgId = "o".parse().expect("org");
        let options = UploadOptions {
            index_path: Some(state.path().join("index")),
            ..UploadOptions::everything()
        };
        let upload = upload_tree(
            &store,
            &org,
            home.path(),
            &options,
            &crate::progress::NoProgress,
        )
        .expect("upload");
        let trees = &upload.scan.collected.trees;
        assert_eq!(trees.len(), 1 + 30 + 30, "root, d*, d*/e*");
        for (digest, node) in trees {
            assert!(
                matches!(node.bytes, crate::scan::TreeBytes::Aside { .. }),
                "{digest} is still held"
            );
            let tree = store.get_tree(&org, digest).expect("uploaded");
            let (encoded_digest, _) = tree.encode().expect("encode");
            assert_eq!(&encoded_digest, digest);
        }
        assert_eq!(upload.report.trees_uploaded, 61);
    }
}
