//! Garbage collection, verification and statistics over a whole store.
//!
//! GC is mark and sweep. It marks from every home pointer (and every tree
//! younger than the grace period, so a push in flight keeps what its new
//! trees reach) and deletes unmarked objects older than the grace period.
//! Any listing or read failure aborts it before a single delete: an error
//! is never taken for "no objects". It holds the store's gc lock from its
//! listing to its last delete, so no push commits a pointer it has not
//! seen (see [`crate::Store::lock_commit`]).
//!
//! Sweep order keeps the invariant the pruned missing-check relies on,
//! "a present tree has its whole subtree present", even if gc dies half
//! way: unreferenced trees go parents first, and blocks only after all
//! trees.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use rayon::prelude::*;

use crate::backend::ObjectMeta;
use crate::store::{KeyKind, ObjectId, ObjectKind, StoreLock, parse_key};
use crate::tree::EntryKind;
use crate::{Digest, Error, HomeName, OrgId, Result, Store};

pub const DEFAULT_GRACE: Duration = Duration::from_secs(3600);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub roots: u64,
    pub objects: u64,
    pub marked: u64,
    pub kept_young: u64,
    pub deleted: u64,
    pub bytes_deleted: u64,
}

type Marked = HashSet<(OrgId, ObjectId)>;

struct Listing {
    homes: Vec<(OrgId, HomeName)>,
    objects: Vec<(OrgId, ObjectId, ObjectMeta)>,
}

fn list(store: &Store) -> Result<Listing> {
    let mut listing = Listing {
        homes: Vec::new(),
        objects: Vec::new(),
    };
    for meta in store.list_all()? {
        match parse_key(&meta.key) {
            Some(KeyKind::Home { org, home }) => listing.homes.push((org, home)),
            Some(KeyKind::Object { org, object }) => listing.objects.push((org, object, meta)),
            None => {}
        }
    }
    Ok(listing)
}

/// Marks everything reachable from `tree`. With `tolerate_missing`, a
/// missing child is skipped (a young tree of a push still uploading).
/// Keeps `lock` fresh as it goes: marking a large store takes longer than
/// a lock lives unrefreshed ([`crate::store::LOCK_STALE`]), and a gc lock
/// that looks stale lets a push commit in the middle of the sweep, onto
/// objects the sweep then deletes.
fn mark_tree(
    store: &Store,
    lock: &StoreLock<'_>,
    org: &OrgId,
    tree: Digest,
    marked: &mut Marked,
    tolerate_missing: bool,
) -> Result<()> {
    let mut stack = vec![tree];
    while let Some(digest) = stack.pop() {
        if !marked.insert((org.clone(), ObjectId::tree(digest))) {
            continue;
        }
        lock.refresh_if_due()?;
        let tree = match store.get_tree(org, &digest) {
            Ok(tree) => tree,
            Err(Error::MissingObject { .. }) if tolerate_missing => continue,
            Err(err) => return Err(err),
        };
        for entry in tree.entries {
            match entry.kind {
                EntryKind::Dir { tree } => stack.push(tree),
                EntryKind::File { blocks } => {
                    marked.extend(
                        blocks
                            .into_iter()
                            .map(|b| (org.clone(), ObjectId::block(b))),
                    );
                }
                EntryKind::Symlink { .. } => {}
            }
        }
    }
    Ok(())
}

fn mark_homes(
    store: &Store,
    lock: &StoreLock<'_>,
    homes: &[(OrgId, HomeName)],
    marked: &mut Marked,
) -> Result<u64> {
    let mut roots = 0;
    for (org, home) in homes {
        lock.refresh_if_due()?;
        if let Some(root) = store.read_home(org, home)? {
            mark_tree(store, lock, org, root, marked, false)?;
            roots += 1;
        }
    }
    Ok(roots)
}

pub fn gc(store: &Store, grace: Duration) -> Result<GcReport> {
    gc_inner(store, grace).map_err(|err| Error::GcAborted(Box::new(err)))
}

fn gc_inner(store: &Store, grace: Duration) -> Result<GcReport> {
    // Held from the listing to the last delete: no push commits meanwhile,
    // so the pointers we mark from are the ones that will exist.
    let lock = store.lock_gc()?;
    let started = SystemTime::now();
    let cutoff = started.checked_sub(grace).unwrap_or(SystemTime::UNIX_EPOCH);
    let listing = list(store)?;
    let mut report = GcReport {
        objects: listing.objects.len() as u64,
        ..GcReport::default()
    };
    let mut marked = Marked::new();
    report.roots = mark_homes(store, &lock, &listing.homes, &mut marked)?;
    for (org, object, meta) in &listing.objects {
        if object.kind == ObjectKind::Tree && meta.last_modified >= cutoff {
            mark_tree(store, &lock, org, object.digest, &mut marked, true)?;
        }
    }
    // Roots committed and trees uploaded while we marked: list once more,
    // so a push that relied on an old object and has since uploaded the
    // trees naming it (or committed) keeps it.
    let again = list(store)?;
    mark_homes(store, &lock, &again.homes, &mut marked)?;
    let first_listing: HashSet<&str> = listing
        .objects
        .iter()
        .map(|(_, _, meta)| meta.key.as_str())
        .collect();
    for (org, object, meta) in &again.objects {
        if object.kind == ObjectKind::Tree && !first_listing.contains(meta.key.as_str()) {
            mark_tree(store, &lock, org, object.digest, &mut marked, true)?;
        }
    }
    report.marked = marked.len() as u64;

    let mut trees = Vec::new();
    let mut blocks = Vec::new();
    for (org, object, meta) in listing.objects {
        if marked.contains(&(org.clone(), object)) {
            continue;
        }
        if meta.last_modified >= cutoff {
            report.kept_young += 1;
            continue;
        }
        match object.kind {
            ObjectKind::Tree => trees.push((org, object, meta)),
            ObjectKind::Block => blocks.push((org, object, meta)),
        }
    }

    // Parents before children among the condemned trees.
    let heights = condemned_heights(store, &trees)?;
    trees.sort_by_key(|(org, object, _)| {
        std::cmp::Reverse(heights.get(&(org.clone(), object.digest)).copied())
    });
    let delete = |(_, _, meta): &(OrgId, ObjectId, ObjectMeta)| store.backend().delete(&meta.key);
    lock.refresh_if_due()?;
    for level in trees.chunk_by(|a, b| {
        heights.get(&(a.0.clone(), a.1.digest)) == heights.get(&(b.0.clone(), b.1.digest))
    }) {
        level.par_iter().try_for_each(delete)?;
        lock.refresh_if_due()?;
    }
    for chunk in blocks.chunks(10_000) {
        chunk.par_iter().try_for_each(delete)?;
        lock.refresh_if_due()?;
    }
    report.deleted = (trees.len() + blocks.len()) as u64;
    report.bytes_deleted = trees
        .iter()
        .chain(&blocks)
        .map(|(_, _, meta)| meta.size)
        .sum();
    Ok(report)
}

/// Height of each condemned tree among condemned trees. A corrupt or
/// malformed one counts as tallest (deleted first: nothing is reachable
/// through it); a backend error aborts gc; one already gone is skipped.
fn condemned_heights(
    store: &Store,
    trees: &[(OrgId, ObjectId, ObjectMeta)],
) -> Result<HashMap<(OrgId, Digest), u32>> {
    type Key = (OrgId, Digest);
    let condemned: HashSet<Key> = trees
        .iter()
        .map(|(org, o, _)| (org.clone(), o.digest))
        .collect();
    let children: HashMap<Key, Option<Vec<Digest>>> = trees
        .par_iter()
        .map(|(org, object, _)| {
            let subtrees = match store.get_tree(org, &object.digest) {
                Ok(tree) => Some(
                    tree.entries
                        .into_iter()
                        .filter_map(|e| match e.kind {
                            EntryKind::Dir { tree } => Some(tree),
                            _ => None,
                        })
                        .collect(),
                ),
                Err(Error::Corrupt { .. } | Error::MalformedTree { .. }) => None,
                Err(Error::MissingObject { .. }) => Some(Vec::new()),
                Err(err) => return Err(err),
            };
            Ok(((org.clone(), object.digest), subtrees))
        })
        .collect::<Result<_>>()?;
    // Bottom-up without recursion: condemned trees can be nested as deep
    // as anyone cared to upload.
    let heights = crate::tree::fold_bottom_up(
        condemned.iter().cloned(),
        |key: &Key| match children.get(key) {
            Some(Some(subtrees)) => subtrees
                .iter()
                .map(|d| (key.0.clone(), *d))
                .filter(|child| condemned.contains(child))
                .collect(),
            _ => Vec::new(),
        },
        |key, below: &[u32]| match children.get(key) {
            Some(Some(_)) => below.iter().map(|h| h.saturating_add(1)).max().unwrap_or(0),
            _ => u32::MAX,
        },
    );
    Ok(heights)
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub roots: u64,
    pub objects_checked: u64,
    pub errors: Vec<String>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.errors.is_empty()
    }
}

/// Checks that every object reachable from every home exists and hashes
/// right. Listing failures are errors; object problems are reported.
pub fn verify(store: &Store) -> Result<VerifyReport> {
    let listing = list(store)?;
    let mut report = VerifyReport::default();
    let mut checked: HashSet<(OrgId, ObjectId)> = HashSet::new();
    for (org, home) in &listing.homes {
        let Some(root) = store.read_home(org, home)? else {
            continue;
        };
        report.roots += 1;
        let mut stack = vec![(root, std::path::PathBuf::new())];
        let mut blocks: Vec<(Digest, std::path::PathBuf)> = Vec::new();
        while let Some((digest, path)) = stack.pop() {
            if !checked.insert((org.clone(), ObjectId::tree(digest))) {
                continue;
            }
            let tree = match store.get_tree(org, &digest) {
                Ok(tree) => tree,
                Err(err) => {
                    report
                        .errors
                        .push(format!("{org}/{home}: {}", err.at(&path)));
                    continue;
                }
            };
            for entry in tree.entries {
                let child = path.join(
                    <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&entry.name),
                );
                match entry.kind {
                    EntryKind::Dir { tree } => stack.push((tree, child)),
                    EntryKind::File { blocks: b } => {
                        for block in b {
                            if checked.insert((org.clone(), ObjectId::block(block))) {
                                blocks.push((block, child.clone()));
                            }
                        }
                    }
                    EntryKind::Symlink { .. } => {}
                }
            }
        }
        let errors: Vec<String> = blocks
            .par_iter()
            .filter_map(|(digest, path)| {
                store
                    .get_object(org, &ObjectId::block(*digest))
                    .err()
                    .map(|err| format!("{org}/{home}: {}", err.at(path)))
            })
            .collect();
        report.errors.extend(errors);
    }
    report.objects_checked = checked.len() as u64;
    Ok(report)
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct OrgStats {
    pub org: String,
    pub homes: u64,
    pub objects: u64,
    pub blocks: u64,
    pub trees: u64,
    pub stored_bytes: u64,
    /// File bytes described by the org's home roots, counted per home.
    pub logical_bytes: u64,
    /// logical / stored: how much deduplication and compression save.
    pub dedup_ratio: f64,
}

pub fn stats(store: &Store) -> Result<Vec<OrgStats>> {
    let listing = list(store)?;
    let mut by_org: std::collections::BTreeMap<String, OrgStats> = Default::default();
    for (org, object, meta) in &listing.objects {
        let stats = by_org.entry(org.to_string()).or_default();
        stats.objects += 1;
        stats.stored_bytes = stats.stored_bytes.saturating_add(meta.size);
        match object.kind {
            ObjectKind::Block => stats.blocks += 1,
            ObjectKind::Tree => stats.trees += 1,
        }
    }
    for (org, home) in &listing.homes {
        let stats = by_org.entry(org.to_string()).or_default();
        stats.homes += 1;
        if let Some(root) = store.read_home(org, home)? {
            let tree = store.get_tree(org, &root)?;
            // Each root's total fits (decoding checks); their sum may not.
            stats.logical_bytes = stats
                .logical_bytes
                .saturating_add(crate::tree::logical_bytes(&tree.entries));
        }
    }
    Ok(by_org
        .into_iter()
        .map(|(org, mut stats)| {
            stats.org = org;
            stats.dedup_ratio = if stats.stored_bytes == 0 {
                0.0
            } else {
                stats.logical_bytes as f64 / stats.stored_bytes as f64
            };
            stats
        })
        .collect())
}
