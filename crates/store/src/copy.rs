//! One store copied into another (`roost store copy`, backups): what the
//! target lacks, verified, resumable, safe while the source is in use.
//!
//! - Packs are copied whole, pack and index as the source has them (ids,
//!   ages and all), where the target has no index of that pack; objects
//!   stored under their own keys (stores from before packs) are copied as
//!   objects, where the target has them in neither layout.
//! - Everything written is checked first: a pack's index decodes and
//!   tells the truth, the pack is as long as it says and every object in
//!   it decodes to its digest; a loose object decodes to its digest. A
//!   fault in the source is reported by name and not copied (a pack's
//!   sound objects go into a new pack of the target), and the copy goes
//!   on.
//! - A pack counts as present by its index, which is written only once
//!   the pack's bytes are synced: a copy killed at any point leaves
//!   nothing that counts as present without being whole, and the next
//!   copy writes what is missing again. Until a copy ends, the target may
//!   hold trees without their subtrees (packs arrive in any order): it is
//!   not a store to push to or pull from before that.
//! - Home pointers go last, and only once the tree each names is complete
//!   in the target ([`crate::check::roots`]). Pointers are read after the
//!   listing of objects: a pointer moved since then may name objects the
//!   listing missed, so the copy lists again and copies what is new (a
//!   few passes at most); a pointer still incomplete after that (its tree
//!   lost in the source meanwhile, or corrupt there) is not written and is
//!   reported.
//!
//! Objects are immutable, so copying while pushes and saves go on is
//! safe: what is new after the listing is left to the next copy. A gc of
//! the source rewriting a pack between the listing and its read only makes
//! the pack gone (skipped); its survivors are in a new pack the next pass
//! lists, if a pointer needs them.

use std::collections::{BTreeMap, HashSet};

use rayon::prelude::*;

use crate::pack::{PackId, PackIndex};
use crate::progress::Progress;
use crate::store::{KeyKind, ObjectId, PackPart, parse_key};
use crate::{Digest, HomeName, Objects, OrgId, Result, Store};

/// Passes at most: the first copies everything listed, later ones what
/// pointers moved onto meanwhile.
const PASSES_MAX: usize = 3;
/// Pack bytes written per round before a sync and their indexes.
const ROUND_BYTES: u64 = 64 * 1024 * 1024;
/// Loose objects read and written per batch.
const LOOSE_BATCH: usize = 1024;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CopyReport {
    /// Packs written whole (pack and index as in the source).
    pub packs_copied: u64,
    /// Packs the target had already.
    pub packs_skipped: u64,
    /// Objects written: those of copied packs, loose ones, and the sound
    /// objects of a faulty pack.
    pub objects_copied: u64,
    /// Objects the target had already (in skipped packs, or loose).
    pub objects_skipped: u64,
    /// Bytes written (packs, indexes, objects).
    pub bytes_copied: u64,
    pub pointers_copied: u64,
    /// Pointers the target had already, naming the same root.
    pub pointers_skipped: u64,
    /// Pointers not written (`org/home: why`): their tree is not complete
    /// in the target.
    pub pointers_held: Vec<String>,
    /// Faults in the source, each naming the org, the pack and the object
    /// where one is at fault; not copied.
    pub corrupt: Vec<String>,
}

impl CopyReport {
    /// Nothing corrupt, every pointer copied.
    pub fn ok(&self) -> bool {
        self.corrupt.is_empty() && self.pointers_held.is_empty()
    }
}

/// Called between a copied pack's bytes and its index.
pub type PackHook<'a> = dyn Fn(&OrgId, &PackId) + Sync + 'a;

/// Hooks into a copy: progress, and the point between a pack's bytes and
/// its index (crash tests kill the process there).
pub struct CopyOptions<'a> {
    pub progress: &'a dyn Progress,
    pub after_pack_data: Option<&'a PackHook<'a>>,
}

/// The source as listed.
#[derive(Default)]
struct Layout {
    homes: Vec<(OrgId, HomeName)>,
    /// (org, pack) → (pack bytes size if listed, index listed)
    packs: BTreeMap<(OrgId, PackId), (Option<u64>, bool)>,
    loose: Vec<(OrgId, ObjectId, u64)>,
}

fn layout(store: &Store) -> Result<(Layout, HashSet<String>)> {
    let mut layout = Layout::default();
    let mut keys = HashSet::new();
    for meta in store.list_all()? {
        match parse_key(&meta.key) {
            Some(KeyKind::Home { org, home }) => layout.homes.push((org, home)),
            Some(KeyKind::Object { org, object }) => layout.loose.push((org, object, meta.size)),
            Some(KeyKind::Pack { org, pack, part }) => {
                let entry = layout.packs.entry((org, pack)).or_insert((None, false));
                match part {
                    PackPart::Data => entry.0 = Some(meta.size),
                    PackPart::Index => entry.1 = true,
                }
            }
            None => {}
        }
        keys.insert(meta.key);
    }
    Ok((layout, keys))
}

/// Copies what `to` lacks of `from`; see the module documentation.
/// Backend errors (either side unreachable, the target full) are errors:
/// the copy stops there, and running it again resumes.
pub fn copy(from: &Store, to: &Store, options: &CopyOptions<'_>) -> Result<CopyReport> {
    let mut report = CopyReport::default();
    // Source faults are reported once, however many passes meet them.
    let mut faulty: HashSet<(OrgId, PackId)> = HashSet::new();
    let mut faulty_loose: HashSet<(OrgId, ObjectId)> = HashSet::new();
    for pass in 0..PASSES_MAX {
        let mut this = CopyReport::default();
        options.progress.phase("listing", None);
        let (source, _) = layout(from)?;
        let (_, target_keys) = layout(to)?;
        let pointers = read_pointers(from, &source.homes)?;
        copy_packs(
            from,
            to,
            &source,
            &target_keys,
            &mut faulty,
            &mut this,
            options,
        )?;
        copy_loose(
            from,
            to,
            &source,
            &target_keys,
            &mut faulty_loose,
            &mut this,
            options,
        )?;
        to.sync()?;
        options.progress.phase("pointers", None);
        let held = copy_pointers(to, &pointers, &mut this)?;
        let last = held.is_empty() || pass + 1 == PASSES_MAX;
        report.merge(this, pass == 0);
        if last {
            report.pointers_held = held;
            break;
        }
    }
    Ok(report)
}

impl CopyReport {
    /// Adds a pass: what it wrote, its faults; what it found present only
    /// from the first pass (later ones find the first one's work).
    fn merge(&mut self, pass: CopyReport, first: bool) {
        self.packs_copied += pass.packs_copied;
        self.objects_copied += pass.objects_copied;
        self.bytes_copied += pass.bytes_copied;
        self.pointers_copied += pass.pointers_copied;
        if first {
            self.packs_skipped = pass.packs_skipped;
            self.objects_skipped = pass.objects_skipped;
            self.pointers_skipped = pass.pointers_skipped;
        }
        self.corrupt.extend(pass.corrupt);
    }
}

/// Every home pointer of the source with its root (gone ones left out).
fn read_pointers(
    from: &Store,
    homes: &[(OrgId, HomeName)],
) -> Result<Vec<(OrgId, HomeName, Digest)>> {
    let read: Vec<Option<(OrgId, HomeName, Digest)>> = homes
        .par_iter()
        .map(|(org, home)| {
            Ok(from
                .read_home(org, home)?
                .map(|root| (org.clone(), home.clone(), root)))
        })
        .collect::<Result<_>>()?;
    Ok(read.into_iter().flatten().collect())
}

/// What one pack's copy came to.
enum PackOutcome {
    /// Whole and sound: its bytes are written, its index waits for the sync.
    Written {
        org: OrgId,
        index: PackIndex,
        index_bytes: Vec<u8>,
        bytes: u64,
    },
    /// Faulty: its sound objects went into a new pack; the faults.
    Salvaged {
        objects: u64,
        bytes: u64,
        faults: Vec<String>,
    },
    /// Gone from the source since the listing (a gc rewrote it).
    Gone,
}

fn copy_packs(
    from: &Store,
    to: &Store,
    source: &Layout,
    target_keys: &HashSet<String>,
    faulty: &mut HashSet<(OrgId, PackId)>,
    report: &mut CopyReport,
    options: &CopyOptions<'_>,
) -> Result<()> {
    let mut wanted: Vec<(OrgId, PackId, u64)> = Vec::new();
    for ((org, pack), (data, index)) in &source.packs {
        if target_keys.contains(&Store::pack_key(org, pack, PackPart::Index)) {
            report.packs_skipped += 1;
            continue;
        }
        if faulty.contains(&(org.clone(), *pack)) {
            continue;
        }
        match (data, index) {
            (Some(size), true) => wanted.push((org.clone(), *pack, *size)),
            (None, true) => {
                faulty.insert((org.clone(), *pack));
                report.corrupt.push(format!(
                    "{org}: pack {pack}: its index is there, its pack is missing"
                ));
            }
            // Bytes without an index: a pack being written, or torn. Not
            // an object of the store yet.
            _ => {}
        }
    }
    let total: u64 = wanted.iter().map(|(_, _, size)| size).sum();
    options.progress.phase("packs", Some(total));
    let mut start = 0;
    while start < wanted.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < wanted.len() && (end == start || bytes + wanted[end].2 <= ROUND_BYTES) {
            bytes += wanted[end].2;
            end += 1;
        }
        let round = &wanted[start..end];
        start = end;
        let outcomes: Vec<PackOutcome> = round
            .par_iter()
            .map(|(org, pack, _)| copy_pack(from, to, org, pack, options))
            .collect::<Result<_>>()?;
        // The bytes are durable before any index names them.
        to.sync()?;
        for ((org, pack, size), outcome) in round.iter().zip(outcomes) {
            options.progress.advance(*size);
            match outcome {
                PackOutcome::Written {
                    org,
                    index,
                    index_bytes,
                    bytes,
                } => {
                    to.put_pack_index(&org, &index, &index_bytes)?;
                    report.packs_copied += 1;
                    report.objects_copied += index.entries.len() as u64;
                    report.bytes_copied += bytes + index_bytes.len() as u64;
                }
                PackOutcome::Salvaged {
                    objects,
                    bytes,
                    faults,
                } => {
                    faulty.insert((org.clone(), *pack));
                    report.objects_copied += objects;
                    report.bytes_copied += bytes;
                    report.corrupt.extend(faults);
                }
                PackOutcome::Gone => {}
            }
        }
    }
    for (org, pack) in source.packs.keys() {
        if target_keys.contains(&Store::pack_key(org, pack, PackPart::Index)) {
            // Counted as skipped objects: read from the target's own index.
            if let Some(Ok(index)) = to.read_pack_index(org, pack)? {
                report.objects_skipped += index.entries.len() as u64;
            }
        }
    }
    Ok(())
}

/// Reads and checks one pack of the source; writes its bytes (sound) or
/// its sound objects (faulty) to the target.
fn copy_pack(
    from: &Store,
    to: &Store,
    org: &OrgId,
    pack: &PackId,
    options: &CopyOptions<'_>,
) -> Result<PackOutcome> {
    let Some(index_bytes) = from.read_pack_index_bytes(org, pack)? else {
        return Ok(PackOutcome::Gone);
    };
    let index = match crate::pack::decode_index(org, pack, &index_bytes) {
        Ok(index) => index,
        Err(reason) => {
            return Ok(PackOutcome::Salvaged {
                objects: 0,
                bytes: 0,
                faults: vec![format!("{org}: pack {pack}: index refused: {reason}")],
            });
        }
    };
    let Some(data) = from.read_pack(org, pack)? else {
        return Ok(PackOutcome::Gone);
    };
    let mut faults = Vec::new();
    if let Err(reason) = crate::pack::check_pack_header(&data) {
        faults.push(format!("{org}: pack {pack}: {reason}"));
    }
    if data.len() as u64 != index.pack_bytes {
        faults.push(format!(
            "{org}: pack {pack} is {} bytes, its index says {} (truncated or altered)",
            data.len(),
            index.pack_bytes
        ));
    }
    let mut sound: Vec<(ObjectId, &[u8])> = Vec::new();
    for entry in &index.entries {
        let range = entry.offset as usize..(entry.offset + u64::from(entry.length)) as usize;
        let digest = entry.object.digest;
        match data.get(range) {
            None => faults.push(format!(
                "{org}: object {digest} in pack {pack}: past the pack's end (truncated pack)"
            )),
            Some(stored) => match crate::block::decode(&digest, stored) {
                Ok(_) => sound.push((entry.object, stored)),
                Err(err) => faults.push(format!("{org}: object {digest} in pack {pack}: {err}")),
            },
        }
    }
    if faults.is_empty() {
        to.put_pack_data(org, pack, &data)?;
        if let Some(hook) = options.after_pack_data {
            hook(org, pack);
        }
        return Ok(PackOutcome::Written {
            org: org.clone(),
            index,
            index_bytes,
            bytes: data.len() as u64,
        });
    }
    // The sound objects the target lacks, in a pack of its own (written
    // pack then index, like any pack).
    let ids: Vec<ObjectId> = sound.iter().map(|(o, _)| *o).collect();
    let lacking: HashSet<ObjectId> = to.missing(org, &ids)?.into_iter().collect();
    let salvage: Vec<(ObjectId, &[u8])> = sound
        .into_iter()
        .filter(|(o, _)| lacking.contains(o))
        .collect();
    let bytes = salvage.iter().map(|(_, b)| b.len() as u64).sum();
    if !salvage.is_empty() {
        to.write_packs(org, &salvage, index.born)?;
    }
    Ok(PackOutcome::Salvaged {
        objects: salvage.len() as u64,
        bytes,
        faults,
    })
}

fn copy_loose(
    from: &Store,
    to: &Store,
    source: &Layout,
    target_keys: &HashSet<String>,
    faulty: &mut HashSet<(OrgId, ObjectId)>,
    report: &mut CopyReport,
    options: &CopyOptions<'_>,
) -> Result<()> {
    let mut by_org: BTreeMap<&OrgId, Vec<(ObjectId, u64)>> = BTreeMap::new();
    for (org, object, size) in &source.loose {
        if target_keys.contains(&Store::object_key(org, object)) {
            report.objects_skipped += 1;
        } else if !faulty.contains(&(org.clone(), *object)) {
            by_org.entry(org).or_default().push((*object, *size));
        }
    }
    let total: u64 = by_org.values().flatten().map(|(_, size)| size).sum();
    options.progress.phase("objects", Some(total));
    for (org, objects) in by_org {
        // Those in the target's packs already (a target repacked since).
        let ids: Vec<ObjectId> = objects.iter().map(|(o, _)| *o).collect();
        let lacking: HashSet<ObjectId> = to.missing(org, &ids)?.into_iter().collect();
        report.objects_skipped += (ids.len() - lacking.len()) as u64;
        let wanted: Vec<ObjectId> = ids.into_iter().filter(|o| lacking.contains(o)).collect();
        for batch in wanted.chunks(LOOSE_BATCH) {
            let read = from.get_loose_batch(org, batch)?;
            let mut sound: Vec<(ObjectId, Vec<u8>)> = Vec::new();
            for (object, bytes) in batch.iter().zip(read) {
                // Gone since the listing (a gc or a repack of the source).
                let Some(bytes) = bytes else { continue };
                options.progress.advance(bytes.len() as u64);
                match crate::block::decode(&object.digest, &bytes) {
                    Ok(_) => sound.push((*object, bytes)),
                    Err(err) => {
                        faulty.insert((org.clone(), *object));
                        report.corrupt.push(format!("{org}: {err}"));
                    }
                }
            }
            let refs: Vec<(ObjectId, &[u8])> =
                sound.iter().map(|(o, b)| (*o, b.as_slice())).collect();
            to.put_loose_batch(org, &refs)?;
            report.objects_copied += refs.len() as u64;
            report.bytes_copied += refs.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
        }
    }
    Ok(())
}

/// Writes each pointer whose tree is complete in the target; answers the
/// others (`org/home: why`).
fn copy_pointers(
    to: &Store,
    pointers: &[(OrgId, HomeName, Digest)],
    report: &mut CopyReport,
) -> Result<Vec<String>> {
    let mut wanted: BTreeMap<&OrgId, Vec<(&HomeName, Digest)>> = BTreeMap::new();
    for (org, home, root) in pointers {
        if to.read_home(org, home)? == Some(*root) {
            report.pointers_skipped += 1;
        } else {
            wanted.entry(org).or_default().push((home, *root));
        }
    }
    let mut held = Vec::new();
    for (org, homes) in wanted {
        let roots: Vec<Digest> = homes.iter().map(|(_, root)| *root).collect();
        let (statuses, _) = crate::check::roots(to, org, &roots, false)?;
        for (home, root) in homes {
            let status = statuses.get(&root).cloned().unwrap_or_default();
            if status.complete() {
                to.write_home(org, home, &root)?;
                report.pointers_copied += 1;
            } else {
                held.push(format!(
                    "{org}/{home}: tree {root} incomplete in the target ({} missing, {} corrupt{})",
                    status.missing,
                    status.corrupt,
                    status
                        .first_fault
                        .map(|o| format!(", e.g. {}", o.digest))
                        .unwrap_or_default()
                ));
            }
        }
    }
    Ok(held)
}
