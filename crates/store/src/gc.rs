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
//! way: unreferenced trees go parents first, a height at a time, and
//! blocks only after all trees.
//!
//! Packs ([`crate::pack`]): an object is dropped from a pack by rewriting
//! the pack: its survivors are written to a new pack (with the survivors
//! of the other packs rewritten in the same round), the store is synced,
//! and only then the old pack's index and bytes are removed, so a live
//! object is always in some pack and a dead one vanishes at once. Every
//! pack holding an unreferenced tree is rewritten in that tree's height
//! round (a dead tree left behind could outlive its dropped children); a
//! pack holding only unreferenced blocks is rewritten when they are at
//! least [`REPACK_DEAD_SHARE_PERCENT`] of its bytes or its live bytes are
//! under [`SMALL_PACK_BYTES`] (its survivors then join a fuller pack), and
//! removed when nothing in it is live. A pack younger than the grace
//! period is never touched (its trees are marked like young trees); a
//! pack without an index, or an index without its pack, is a torn write,
//! removed once older than the grace period; a pack whose index lies is
//! kept and reported (nothing reads through it).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use rayon::prelude::*;

use crate::backend::ObjectMeta;
use crate::pack::{PACK_HEADER_BYTES, PackId, PackIndex};
use crate::store::{KeyKind, ObjectId, ObjectKind, PackPart, StoreLock, parse_key};
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
    /// Packs read (with a readable index) in the first listing.
    pub packs: u64,
    /// Packs removed (rewritten or wholly dead), torn ones included.
    pub packs_deleted: u64,
    /// New packs written by rewrites.
    pub packs_written: u64,
    /// Live bytes copied by rewrites.
    pub bytes_copied: u64,
    /// Unreferenced old objects left in packs below the rewrite rule.
    pub dead_kept: u64,
    /// Packs whose index lies (kept; `store verify` names the fault).
    pub packs_refused: u64,
}

/// A pack of unreferenced blocks is rewritten once they are at least this
/// share of its object bytes: a rewrite then copies at most three live
/// bytes per dead byte it frees, and a store carries at most about a
/// quarter of dead bytes between collections.
pub const REPACK_DEAD_SHARE_PERCENT: u64 = 25;
/// A pack with an unreferenced object and fewer live bytes than this is
/// rewritten whatever its dead share: copying it costs less than a
/// request, and its survivors join others in a fuller pack (incremental
/// pushes leave many small packs).
pub const SMALL_PACK_BYTES: u64 = 1024 * 1024;

type Marked = HashSet<(OrgId, ObjectId)>;

struct Listing {
    homes: Vec<(OrgId, HomeName)>,
    objects: Vec<(OrgId, ObjectId, ObjectMeta)>,
    packs: Vec<ListedPack>,
}

/// A pack's files as listed: either may be missing (a torn write).
#[derive(Clone, Debug)]
struct ListedPack {
    org: OrgId,
    pack: PackId,
    data: Option<ObjectMeta>,
    index: Option<ObjectMeta>,
}

/// A pack with its index read.
#[derive(Clone, Debug)]
struct Pack {
    org: OrgId,
    index: PackIndex,
    modified: SystemTime,
}

fn list(store: &Store) -> Result<Listing> {
    let mut listing = Listing {
        homes: Vec::new(),
        objects: Vec::new(),
        packs: Vec::new(),
    };
    let mut packs: std::collections::BTreeMap<(OrgId, PackId), ListedPack> = Default::default();
    for meta in store.list_all()? {
        match parse_key(&meta.key) {
            Some(KeyKind::Home { org, home }) => listing.homes.push((org, home)),
            Some(KeyKind::Object { org, object }) => listing.objects.push((org, object, meta)),
            Some(KeyKind::Pack { org, pack, part }) => {
                let listed = packs
                    .entry((org.clone(), pack))
                    .or_insert_with(|| ListedPack {
                        org,
                        pack,
                        data: None,
                        index: None,
                    });
                match part {
                    PackPart::Data => listed.data = Some(meta),
                    PackPart::Index => listed.index = Some(meta),
                }
            }
            None => {}
        }
    }
    listing.packs = packs.into_values().collect();
    Ok(listing)
}

/// Packs whose index was refused, with why.
type Refused = Vec<(ListedPack, String)>;

/// Reads the index of every listed pack that has both files: the packs,
/// and those refused with why. A read error is an error.
fn read_packs(store: &Store, listed: &[ListedPack]) -> Result<(Vec<Pack>, Refused)> {
    let read: Vec<(ListedPack, Option<std::result::Result<PackIndex, String>>)> = listed
        .par_iter()
        .filter(|listed| listed.data.is_some() && listed.index.is_some())
        .map(|listed| {
            Ok((
                listed.clone(),
                store.read_pack_index(&listed.org, &listed.pack)?,
            ))
        })
        .collect::<Result<_>>()?;
    let mut packs = Vec::new();
    let mut refused = Vec::new();
    for (listed, index) in read {
        match index {
            // Removed since the listing (another gc): nothing to do.
            None => {}
            Some(Ok(index)) => {
                let written = listed
                    .data
                    .as_ref()
                    .map_or(SystemTime::UNIX_EPOCH, |m| m.last_modified);
                packs.push(Pack {
                    org: listed.org.clone(),
                    modified: index.born.map_or(written, |born| born.min(written)),
                    index,
                })
            }
            Some(Err(reason)) => refused.push((listed, reason)),
        }
    }
    Ok((packs, refused))
}

/// Marks everything reachable from `tree`. With `tolerate_missing`, a
/// missing child is skipped (a young tree of a push still uploading).
/// Keeps `lock` fresh as it goes: marking a large store takes longer than
/// a lock lives unrefreshed ([`crate::store::LOCK_STALE`]), and a gc lock
/// that looks stale lets a push commit in the middle of the sweep, onto
/// objects the sweep then deletes.
fn mark_tree(
    store: &Store,
    lock: Option<&StoreLock<'_>>,
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
        if let Some(lock) = lock {
            lock.refresh_if_due()?;
        }
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
    lock: Option<&StoreLock<'_>>,
    homes: &[(OrgId, HomeName)],
    marked: &mut Marked,
) -> Result<u64> {
    let mut roots = 0;
    for (org, home) in homes {
        if let Some(lock) = lock {
            lock.refresh_if_due()?;
        }
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

/// Marks every tree of `packs` (young packs, or packs new since the first
/// listing) with what it reaches, tolerating holes (a push still uploading).
fn mark_pack_trees(
    store: &Store,
    lock: Option<&StoreLock<'_>>,
    packs: &[&Pack],
    marked: &mut Marked,
) -> Result<()> {
    for pack in packs {
        for entry in &pack.index.entries {
            if entry.object.kind == ObjectKind::Tree {
                mark_tree(store, lock, &pack.org, entry.object.digest, marked, true)?;
            }
        }
    }
    Ok(())
}

fn gc_inner(store: &Store, grace: Duration) -> Result<GcReport> {
    // Held from the listing to the last delete: no push commits meanwhile,
    // so the pointers we mark from are the ones that will exist.
    let lock = store.lock_gc()?;
    let started = SystemTime::now();
    let cutoff = started.checked_sub(grace).unwrap_or(SystemTime::UNIX_EPOCH);
    let listing = list(store)?;
    let (packs, refused) = read_packs(store, &listing.packs)?;
    let packed_objects: usize = packs.iter().map(|p| p.index.entries.len()).sum();
    let mut report = GcReport {
        objects: (listing.objects.len() + packed_objects) as u64,
        packs: packs.len() as u64,
        packs_refused: refused.len() as u64,
        ..GcReport::default()
    };
    for (listed, reason) in &refused {
        tracing::warn!(org = %listed.org, pack = %listed.pack, %reason, "pack index refused; the pack is kept");
    }
    let mut marked = Marked::new();
    report.roots = mark_homes(store, Some(&lock), &listing.homes, &mut marked)?;
    for (org, object, meta) in &listing.objects {
        if object.kind == ObjectKind::Tree && meta.last_modified >= cutoff {
            mark_tree(store, Some(&lock), org, object.digest, &mut marked, true)?;
        }
    }
    let young: Vec<&Pack> = packs.iter().filter(|p| p.modified >= cutoff).collect();
    mark_pack_trees(store, Some(&lock), &young, &mut marked)?;
    // Roots committed and trees uploaded while we marked: list once more,
    // so a push that relied on an old object and has since uploaded the
    // trees naming it (or committed) keeps it.
    let again = list(store)?;
    mark_homes(store, Some(&lock), &again.homes, &mut marked)?;
    let first_listing: HashSet<&str> = listing
        .objects
        .iter()
        .map(|(_, _, meta)| meta.key.as_str())
        .collect();
    for (org, object, meta) in &again.objects {
        if object.kind == ObjectKind::Tree && !first_listing.contains(meta.key.as_str()) {
            mark_tree(store, Some(&lock), org, object.digest, &mut marked, true)?;
        }
    }
    let first_packs: HashSet<(&OrgId, &PackId)> =
        listing.packs.iter().map(|p| (&p.org, &p.pack)).collect();
    let new_listed: Vec<ListedPack> = again
        .packs
        .iter()
        .filter(|p| !first_packs.contains(&(&p.org, &p.pack)))
        .cloned()
        .collect();
    let (new_packs, _) = read_packs(store, &new_listed)?;
    mark_pack_trees(
        store,
        Some(&lock),
        &new_packs.iter().collect::<Vec<_>>(),
        &mut marked,
    )?;
    report.marked = marked.len() as u64;

    let mut loose_trees = Vec::new();
    let mut loose_blocks = Vec::new();
    for (org, object, meta) in listing.objects {
        if marked.contains(&(org.clone(), object)) {
            continue;
        }
        if meta.last_modified >= cutoff {
            report.kept_young += 1;
            continue;
        }
        match object.kind {
            ObjectKind::Tree => loose_trees.push((org, object, meta)),
            ObjectKind::Block => loose_blocks.push((org, object, meta)),
        }
    }
    let mut condemned: HashSet<(OrgId, ObjectId)> = HashSet::new();
    let mut current: Vec<Pack> = Vec::new();
    for pack in packs {
        let unmarked = pack
            .index
            .entries
            .iter()
            .filter(|e| !marked.contains(&(pack.org.clone(), e.object)))
            .count();
        if pack.modified >= cutoff {
            report.kept_young += unmarked as u64;
            continue;
        }
        if unmarked == 0 {
            continue;
        }
        for entry in &pack.index.entries {
            if !marked.contains(&(pack.org.clone(), entry.object)) {
                condemned.insert((pack.org.clone(), entry.object));
            }
        }
        current.push(pack);
    }

    // Parents before children among the condemned trees, loose or packed.
    let mut condemned_trees: Vec<(OrgId, Digest)> = loose_trees
        .iter()
        .map(|(org, object, _)| (org.clone(), object.digest))
        .chain(
            condemned
                .iter()
                .filter(|(_, o)| o.kind == ObjectKind::Tree)
                .map(|(org, o)| (org.clone(), o.digest)),
        )
        .collect();
    condemned_trees.sort();
    condemned_trees.dedup();
    let heights = condemned_heights(store, &condemned_trees)?;
    let height_of = |org: &OrgId, digest: &Digest| heights.get(&(org.clone(), *digest)).copied();
    let mut levels: Vec<u32> = heights.values().copied().collect();
    levels.sort_unstable_by(|a, b| b.cmp(a));
    levels.dedup();
    let delete = |(org, object, _): &(OrgId, ObjectId, ObjectMeta)| store.delete_loose(org, object);
    lock.refresh_if_due()?;
    for level in levels {
        let here: Vec<&(OrgId, ObjectId, ObjectMeta)> = loose_trees
            .iter()
            .filter(|(org, o, _)| height_of(org, &o.digest) == Some(level))
            .collect();
        here.par_iter().try_for_each(|t| delete(t))?;
        // Packs holding a condemned tree of this height drop it now (and
        // nothing lower: those wait for their own round).
        let drop_here = |org: &OrgId, object: &ObjectId| {
            object.kind == ObjectKind::Tree
                && condemned.contains(&(org.clone(), *object))
                && height_of(org, &object.digest).is_some_and(|h| h >= level)
        };
        let dropped = rewrite_round(
            store,
            &lock,
            &mut current,
            &mut report,
            |pack| {
                pack.index
                    .entries
                    .iter()
                    .any(|e| drop_here(&pack.org, &e.object))
            },
            &drop_here,
        )?;
        for object in &dropped {
            condemned.remove(object);
        }
        lock.refresh_if_due()?;
    }
    for chunk in loose_blocks.chunks(10_000) {
        chunk.par_iter().try_for_each(delete)?;
        lock.refresh_if_due()?;
    }
    let drop_block = |org: &OrgId, object: &ObjectId| condemned.contains(&(org.clone(), *object));
    let mut dead_kept = 0;
    let worth_rewriting = |pack: &Pack| {
        let dead: u64 = pack
            .index
            .entries
            .iter()
            .filter(|e| drop_block(&pack.org, &e.object))
            .map(|e| u64::from(e.length))
            .sum();
        let total = pack.index.pack_bytes - PACK_HEADER_BYTES;
        dead > 0
            && (dead * 100 >= total * REPACK_DEAD_SHARE_PERCENT || total - dead < SMALL_PACK_BYTES)
    };
    for pack in &current {
        if !worth_rewriting(pack) {
            dead_kept += pack
                .index
                .entries
                .iter()
                .filter(|e| drop_block(&pack.org, &e.object))
                .count() as u64;
        }
    }
    rewrite_round(
        store,
        &lock,
        &mut current,
        &mut report,
        worth_rewriting,
        &drop_block,
    )?;
    report.dead_kept = dead_kept;
    // Torn writes: a pack without its index, an index without its pack.
    for listed in &listing.packs {
        let torn = listed.data.is_none() != listed.index.is_none();
        let old = [&listed.data, &listed.index]
            .into_iter()
            .flatten()
            .all(|meta| meta.last_modified < cutoff);
        if torn && old {
            store.delete_pack(&listed.org, &listed.pack)?;
            report.packs_deleted += 1;
        }
    }
    report.deleted += (loose_trees.len() + loose_blocks.len()) as u64;
    report.bytes_deleted += loose_trees
        .iter()
        .chain(&loose_blocks)
        .map(|(_, _, meta)| meta.size)
        .sum::<u64>();
    Ok(report)
}

/// One round of pack rewrites: each pack of `current` for which `choose`
/// gives a drop rule loses the objects the rule names. Survivors of all
/// of them go to new packs (per org, as full as the bound allows), the
/// store is synced, and only then are the old packs removed. `current`
/// then holds the new packs in place of the old.
fn rewrite_round(
    store: &Store,
    lock: &StoreLock<'_>,
    current: &mut Vec<Pack>,
    report: &mut GcReport,
    choose: impl Fn(&Pack) -> bool,
    rule: &dyn Fn(&OrgId, &ObjectId) -> bool,
) -> Result<Vec<(OrgId, ObjectId)>> {
    let chosen: Vec<usize> = (0..current.len())
        .filter(|&i| choose(&current[i]))
        .collect();
    if chosen.is_empty() {
        return Ok(Vec::new());
    }
    // Survivors per org, read a pack at a time and written a pack's worth
    // at a time (memory: about a pack per org), each new pack keeping the
    // age of the oldest pack its objects come from.
    let mut pending: HashMap<OrgId, Survivors> = HashMap::new();
    let mut written: Vec<Pack> = Vec::new();
    let mut dropped: Vec<(OrgId, ObjectId)> = Vec::new();
    let mut skipped: Vec<usize> = Vec::new();
    for i in &chosen {
        let pack = &current[*i];
        lock.refresh_if_due()?;
        let keep: Vec<_> = pack
            .index
            .entries
            .iter()
            .filter(|e| !rule(&pack.org, &e.object))
            .collect();
        let bytes = if keep.is_empty() {
            Vec::new()
        } else {
            match store.read_pack(&pack.org, &pack.index.pack)? {
                Some(bytes) if bytes.len() as u64 == pack.index.pack_bytes => bytes,
                // Another gc rewrote it first: its survivors are there.
                None => {
                    skipped.push(*i);
                    continue;
                }
                // Truncated: left as it is, for `store verify` to name.
                Some(bytes) => {
                    tracing::warn!(org = %pack.org, pack = %pack.index.pack, bytes = bytes.len(), expected = pack.index.pack_bytes, "truncated pack left as it is");
                    report.packs_refused += 1;
                    skipped.push(*i);
                    continue;
                }
            }
        };
        let survivors = pending
            .entry(pack.org.clone())
            .or_insert_with(|| Survivors {
                objects: Vec::new(),
                bytes: 0,
                born: pack.modified,
            });
        survivors.born = survivors.born.min(pack.modified);
        for entry in &keep {
            let range = entry.offset as usize..(entry.offset + u64::from(entry.length)) as usize;
            report.bytes_copied += u64::from(entry.length);
            survivors.bytes += u64::from(entry.length);
            survivors
                .objects
                .push((entry.object, bytes[range].to_vec()));
        }
        for entry in &pack.index.entries {
            if rule(&pack.org, &entry.object) {
                dropped.push((pack.org.clone(), entry.object));
                report.bytes_deleted += u64::from(entry.length);
            }
        }
        if survivors.bytes >= crate::pack::PACK_BYTES_MAX
            && let Some(full) = pending.remove(&pack.org)
        {
            written.extend(full.write(store, &pack.org)?);
        }
    }
    for (org, survivors) in pending {
        written.extend(survivors.write(store, &org)?);
        lock.refresh_if_due()?;
    }
    report.packs_written += written.len() as u64;
    store.sync()?;
    let old: Vec<(OrgId, PackId)> = chosen
        .iter()
        .filter(|i| !skipped.contains(i))
        .map(|i| (current[*i].org.clone(), current[*i].index.pack))
        .collect();
    old.par_iter()
        .try_for_each(|(org, pack)| store.delete_pack(org, pack))?;
    report.packs_deleted += old.len() as u64;
    report.deleted += dropped.len() as u64;
    // A skipped pack stays in `current`, as it is.
    let chosen_set: HashSet<usize> = chosen
        .iter()
        .filter(|i| !skipped.contains(i))
        .copied()
        .collect();
    let mut kept: Vec<Pack> = current
        .drain(..)
        .enumerate()
        .filter(|(i, _)| !chosen_set.contains(i))
        .map(|(_, p)| p)
        .collect();
    kept.extend(written);
    *current = kept;
    Ok(dropped)
}

/// Survivors of rewritten packs waiting to be written.
struct Survivors {
    objects: Vec<(ObjectId, Vec<u8>)>,
    bytes: u64,
    /// The oldest pack they come from.
    born: SystemTime,
}

impl Survivors {
    fn write(self, store: &Store, org: &OrgId) -> Result<Vec<Pack>> {
        if self.objects.is_empty() {
            return Ok(Vec::new());
        }
        let refs: Vec<(ObjectId, &[u8])> = self
            .objects
            .iter()
            .map(|(o, b)| (*o, b.as_slice()))
            .collect();
        Ok(store
            .write_packs(org, &refs, Some(self.born))?
            .into_iter()
            .map(|index| Pack {
                org: org.clone(),
                index,
                modified: self.born,
            })
            .collect())
    }
}

/// Height of each condemned tree among condemned trees. A corrupt or
/// malformed one counts as tallest (deleted first: nothing is reachable
/// through it); a backend error aborts gc; one already gone is skipped.
fn condemned_heights(
    store: &Store,
    trees: &[(OrgId, Digest)],
) -> Result<HashMap<(OrgId, Digest), u32>> {
    type Key = (OrgId, Digest);
    let condemned: HashSet<Key> = trees.iter().cloned().collect();
    let children: HashMap<Key, Option<Vec<Digest>>> = trees
        .par_iter()
        .map(|(org, digest)| {
            let subtrees = match store.get_tree(org, digest) {
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
            Ok(((org.clone(), *digest), subtrees))
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
    /// Packs whose index and every object were read.
    pub packs_checked: u64,
    pub errors: Vec<String>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.errors.is_empty()
    }
}

/// Checks every pack and its index (the index decodes and tells the
/// truth, the pack is as long as it says, every object in it hashes
/// right), then that every object reachable from every home exists and
/// hashes right. Listing failures are errors; object problems are
/// reported, naming the object and its pack or path.
pub fn verify(store: &Store) -> Result<VerifyReport> {
    let listing = list(store)?;
    let mut report = VerifyReport::default();
    let pack_errors: Vec<Vec<(Option<Digest>, String)>> = listing
        .packs
        .par_iter()
        .filter(|listed| listed.index.is_some())
        .map(|listed| verify_pack(store, listed))
        .collect::<Result<_>>()?;
    report.packs_checked = pack_errors.len() as u64;
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
    // Then what the packs hold beyond that: an object reported above
    // (with its path) is not reported again.
    let reported: Vec<String> = report.errors.clone();
    for (object, error) in pack_errors.into_iter().flatten() {
        if object.is_some_and(|digest| {
            let name = digest.to_hex();
            reported.iter().any(|e| e.contains(&name))
        }) {
            continue;
        }
        report.errors.push(error);
    }
    Ok(report)
}

/// One pack's faults, each naming the org, the pack and (where one is at
/// fault) the object.
fn verify_pack(store: &Store, listed: &ListedPack) -> Result<Vec<(Option<Digest>, String)>> {
    let (org, pack) = (&listed.org, &listed.pack);
    let index = match store.read_pack_index(org, pack)? {
        None => return Ok(Vec::new()),
        Some(Err(reason)) => {
            return Ok(vec![(
                None,
                format!("{org}: pack {pack}: index refused: {reason}"),
            )]);
        }
        Some(Ok(index)) => index,
    };
    let Some(bytes) = store.read_pack(org, pack)? else {
        return Ok(vec![(
            None,
            format!(
                "{org}: pack {pack}: its index names {} objects but the pack is missing",
                index.entries.len()
            ),
        )]);
    };
    let mut errors = Vec::new();
    if let Err(reason) = crate::pack::check_pack_header(&bytes) {
        errors.push((None, format!("{org}: pack {pack}: {reason}")));
    }
    if bytes.len() as u64 != index.pack_bytes {
        errors.push((
            None,
            format!(
                "{org}: pack {pack} is {} bytes, its index says {} (truncated or altered)",
                bytes.len(),
                index.pack_bytes
            ),
        ));
    }
    for entry in &index.entries {
        let range = entry.offset as usize..(entry.offset + u64::from(entry.length)) as usize;
        let object = entry.object.digest;
        match bytes.get(range) {
            None => errors.push((
                Some(object),
                format!(
                    "{org}: object {object} in pack {pack}: past the pack's end (truncated pack)"
                ),
            )),
            Some(stored) => {
                if let Err(err) = crate::block::decode(&object, stored) {
                    errors.push((
                        Some(object),
                        format!("{org}: object {object} in pack {pack}: {err}"),
                    ));
                }
            }
        }
    }
    Ok(errors)
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
    pub packs: u64,
    /// Objects stored under their own keys (from before packs).
    pub loose: u64,
    /// Stored bytes no home reaches (a gc past the grace period frees
    /// those of loose objects and of packs it rewrites).
    pub dead_bytes: u64,
    /// Packs a gc would rewrite or remove now (past the grace period).
    pub repack_candidates: u64,
    /// Packs whose index lies (kept; `store verify` names the fault).
    pub packs_refused: u64,
}

pub fn stats(store: &Store) -> Result<Vec<OrgStats>> {
    let listing = list(store)?;
    let (packs, refused) = read_packs(store, &listing.packs)?;
    let mut by_org: std::collections::BTreeMap<String, OrgStats> = Default::default();
    let count = |stats: &mut OrgStats, object: &ObjectId| {
        stats.objects += 1;
        match object.kind {
            ObjectKind::Block => stats.blocks += 1,
            ObjectKind::Tree => stats.trees += 1,
        }
    };
    for (org, object, meta) in &listing.objects {
        let stats = by_org.entry(org.to_string()).or_default();
        count(stats, object);
        stats.stored_bytes = stats.stored_bytes.saturating_add(meta.size);
    }
    for listed in &listing.packs {
        let stats = by_org.entry(listed.org.to_string()).or_default();
        for meta in [&listed.data, &listed.index].into_iter().flatten() {
            stats.stored_bytes = stats.stored_bytes.saturating_add(meta.size);
        }
    }
    for pack in &packs {
        let stats = by_org.entry(pack.org.to_string()).or_default();
        stats.packs += 1;
        for entry in &pack.index.entries {
            count(stats, &entry.object);
        }
    }
    for (listed, _) in &refused {
        by_org
            .entry(listed.org.to_string())
            .or_default()
            .packs_refused += 1;
    }
    let mut marked = Marked::new();
    for (org, home) in &listing.homes {
        let stats = by_org.entry(org.to_string()).or_default();
        stats.homes += 1;
        if let Some(root) = store.read_home(org, home)? {
            let tree = store.get_tree(org, &root)?;
            // Each root's total fits (decoding checks); their sum may not.
            stats.logical_bytes = stats
                .logical_bytes
                .saturating_add(crate::tree::logical_bytes(&tree.entries));
            // A hole is verify's to report; stats counts what is there.
            mark_tree(store, None, org, root, &mut marked, true)?;
        }
    }
    // Dead: what no home reaches (young trees' objects included: stats
    // says what a gc past the grace period would find).
    for pack in &packs {
        let stats = by_org.entry(pack.org.to_string()).or_default();
        let dead: u64 = pack
            .index
            .entries
            .iter()
            .filter(|e| !marked.contains(&(pack.org.clone(), e.object)))
            .map(|e| u64::from(e.length))
            .sum();
        let total = pack.index.pack_bytes - PACK_HEADER_BYTES;
        stats.dead_bytes += dead;
        if dead > 0
            && (dead * 100 >= total * REPACK_DEAD_SHARE_PERCENT || total - dead < SMALL_PACK_BYTES)
        {
            stats.repack_candidates += 1;
        }
    }
    for (org, object, meta) in &listing.objects {
        if !marked.contains(&(org.clone(), *object)) {
            by_org.entry(org.to_string()).or_default().dead_bytes += meta.size;
        }
        by_org.entry(org.to_string()).or_default().loose += 1;
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

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepackReport {
    /// Objects moved from their own keys into packs.
    pub objects_moved: u64,
    pub bytes_moved: u64,
    pub packs_written: u64,
    /// Objects left where they are: they do not decode to their name.
    pub corrupt: Vec<String>,
}

/// Objects read and packed per round of [`repack_loose`]: one pack's worth.
const REPACK_ROUND_BYTES: u64 = crate::pack::PACK_BYTES_MAX;

/// Moves every object stored under its own key (a store from before
/// packs) into packs, online: each round writes a pack's worth, syncs,
/// and only then removes those objects' own keys, so every object is
/// present throughout (a copy is removed, never an object: pushes and
/// gc may run meanwhile). An object that does not decode to its name is
/// left in place and reported (`store verify` finds it too).
pub fn repack_loose(store: &Store) -> Result<RepackReport> {
    let listing = list(store)?;
    let mut report = RepackReport::default();
    let mut by_org: std::collections::BTreeMap<OrgId, Vec<(ObjectId, ObjectMeta)>> =
        Default::default();
    for (org, object, meta) in listing.objects {
        by_org.entry(org).or_default().push((object, meta));
    }
    for (org, objects) in by_org {
        let mut start = 0;
        while start < objects.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < objects.len()
                && (end == start || bytes + objects[end].1.size <= REPACK_ROUND_BYTES)
            {
                bytes += objects[end].1.size;
                end += 1;
            }
            let round = &objects[start..end];
            start = end;
            let ids: Vec<ObjectId> = round.iter().map(|(o, _)| *o).collect();
            let keys: Vec<String> = ids.iter().map(|o| Store::object_key(&org, o)).collect();
            let read = store.backend().get_batch(&keys)?;
            let mut moving: Vec<(ObjectId, Vec<u8>)> = Vec::new();
            let oldest = round.iter().map(|(_, meta)| meta.last_modified).min();
            for (object, stored) in ids.iter().zip(read) {
                // Gone since the listing (a gc): nothing to move.
                let Some(stored) = stored else { continue };
                match crate::block::decode(&object.digest, &stored) {
                    Ok(_) => moving.push((*object, stored)),
                    Err(err) => report.corrupt.push(format!("{org}: {err}")),
                }
            }
            if moving.is_empty() {
                continue;
            }
            let refs: Vec<(ObjectId, &[u8])> =
                moving.iter().map(|(o, b)| (*o, b.as_slice())).collect();
            report.packs_written += store.write_packs(&org, &refs, oldest)?.len() as u64;
            store.sync()?;
            moving
                .par_iter()
                .try_for_each(|(object, _)| store.delete_loose(&org, object))?;
            report.objects_moved += moving.len() as u64;
            report.bytes_moved += moving.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
        }
    }
    Ok(report)
}
