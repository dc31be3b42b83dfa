//! The org's merged pack index: every entry of the org's pack indexes in
//! one local file sorted by object (like git's multi-pack-index), so "is
//! this object here" and "where" need no index in memory.
//!
//! Why: an in-memory map of every object costs ~64 bytes an object (6 GiB
//! at 100 million). This file costs nothing per object in memory beyond
//! a sparse table of every [`SAMPLE_EVERY`]th key's first 8 bytes
//! (0.125 bytes an object, ~12 MiB at 100 million), plus 16 bytes per
//! pack; the entries stay on disk, in the page cache the kernel may
//! reclaim. A lookup is a search of the sparse table, then one positioned
//! read of at most [`SAMPLE_EVERY`] entries (~3 KiB), searched in memory.
//!
//! It is a cache, never the truth: built from the packs' own indexes
//! ([`crate::pack`]) and rebuilt from them when missing, damaged, of
//! another org or version, or naming a pack that is gone. Opening one
//! reads it once whole to check its checksum (and order, and every slot),
//! so a file is never trusted without it.
//!
//! Encoding, version 1 (integers little-endian):
//!
//! ```text
//! magic "RMIDX" · version u8 = 1
//! org name length u8 · org name bytes
//! pack count u32 · pack ids, 16 bytes each, strictly ascending (a pack's
//!                  slot is its place in this list)
//! entries, sorted by (digest, kind), then pack id (an object stored in
//!   two packs has two entries; a reader takes the first):
//!   digest [32] · kind u8 (1 block, 2 tree) · slot u32 · offset u64
//!   · length u32
//! fanout: 256 × u64, entry i = entries whose digest's first byte <= i
//! entry count u64
//! BLAKE3 of every byte above: [32]
//! ```
//!
//! Building one is a merge of sorted runs, never every entry in memory:
//! the previous file (its entries of packs still listed), and the other
//! packs' index entries sorted in chunks of [`CHUNK_ENTRIES`] (spilled to
//! unlinked temporary files when there is more than one chunk), merged
//! through a heap of one entry per run.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::OrgId;
use crate::pack::{PackId, PackIndex};
use crate::store::{Location, ObjectId, ObjectKind};

const MAGIC: &[u8; 5] = b"RMIDX";
const VERSION: u8 = 1;
const KIND_BLOCK: u8 = 1;
const KIND_TREE: u8 = 2;
/// digest 32 · kind 1 · slot 4 · offset 8 · length 4.
const ENTRY_BYTES: usize = 49;
/// The bytes entries sort by: digest then kind.
const KEY_BYTES: usize = 33;
const FANOUT_BYTES: usize = 256 * 8;
const TRAILER_BYTES: usize = FANOUT_BYTES + 8 + 32;
/// One key in this many is kept in memory: a lookup reads at most this
/// many entries (~3 KiB) with one positioned read.
pub const SAMPLE_EVERY: u64 = 64;
/// Entries sorted in memory at once while building (~16 MiB of
/// [`RunEntry`]); more spill to temporary files, merged afterwards.
pub const CHUNK_ENTRIES: usize = 256 * 1024;
/// Entries checked per read while opening (~49 KiB).
const OPEN_READ_ENTRIES: usize = 1024;

/// The file's name in an org's directory of the index cache.
pub const FILE_NAME: &str = "merged.midx";

/// An opened, checked merged index.
#[derive(Debug)]
pub struct MergedIndex {
    file: File,
    path: PathBuf,
    /// Ascending; an entry's slot indexes it.
    packs: Vec<PackId>,
    count: u64,
    entries_at: u64,
    fanout: Box<[u64; 256]>,
    /// The first 8 digest bytes (big-endian) of entries 0, 64, 128, ...
    samples: Vec<u64>,
}

/// One entry while merging; orders by object, then pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RunEntry {
    key: [u8; KEY_BYTES],
    pack: PackId,
    offset: u64,
    length: u32,
}

/// digest 32 · kind 1 · pack 16 · offset 8 · length 4.
const SPILL_ENTRY_BYTES: usize = KEY_BYTES + 16 + 8 + 4;

fn key_of(object: &ObjectId) -> [u8; KEY_BYTES] {
    let mut key = [0u8; KEY_BYTES];
    key[..32].copy_from_slice(&object.digest.0);
    key[32] = match object.kind {
        ObjectKind::Block => KIND_BLOCK,
        ObjectKind::Tree => KIND_TREE,
    };
    key
}

fn prefix_of(key: &[u8]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&key[..8]);
    u64::from_be_bytes(first)
}

impl MergedIndex {
    /// Opens and checks the file at `path` as `org`'s: `Ok(None)` if there
    /// is none, `Err` naming why one is refused (the caller rebuilds it).
    pub fn open(path: &Path, org: &OrgId) -> Result<Option<MergedIndex>, String> {
        let file = match File::open(path) {
            Ok(file) => file,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(err.to_string()),
        };
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        let mut reader = BufReader::with_capacity(64 * 1024, PositionedReader::new(&file, 0));
        let mut hasher = blake3::Hasher::new();
        let mut read = |n: usize, hasher: &mut blake3::Hasher| -> Result<Vec<u8>, String> {
            let mut bytes = vec![0u8; n];
            reader
                .read_exact(&mut bytes)
                .map_err(|_| "cut short".to_owned())?;
            hasher.update(&bytes);
            Ok(bytes)
        };
        let head = read(7, &mut hasher)?;
        if &head[..5] != MAGIC {
            return Err("not a merged pack index (bad magic)".to_owned());
        }
        if head[5] != VERSION {
            return Err(format!("unknown merged index version {}", head[5]));
        }
        let named_org = read(head[6] as usize, &mut hasher)?;
        if named_org != org.as_str().as_bytes() {
            return Err(format!(
                "it indexes org {:?}, not {org}",
                String::from_utf8_lossy(&named_org)
            ));
        }
        let pack_count = u32::from_le_bytes(read(4, &mut hasher)?.try_into().expect("4 bytes"));
        let packs_bytes = u64::from(pack_count) * 16;
        let entries_at = 7 + u64::from(head[6]) + 4 + packs_bytes;
        let entries_bytes = len
            .checked_sub(entries_at + TRAILER_BYTES as u64)
            .ok_or("shorter than its header and trailer")?;
        if entries_bytes % ENTRY_BYTES as u64 != 0 {
            return Err(format!("{entries_bytes} bytes of entries"));
        }
        let count = entries_bytes / ENTRY_BYTES as u64;
        let mut packs = Vec::with_capacity(pack_count as usize);
        for _ in 0..pack_count {
            let id = PackId(read(16, &mut hasher)?.try_into().expect("16 bytes"));
            if packs.last().is_some_and(|last| *last >= id) {
                return Err("pack ids out of order".to_owned());
            }
            packs.push(id);
        }
        let mut fanout = Box::new([0u64; 256]);
        let mut samples = Vec::with_capacity(count.div_ceil(SAMPLE_EVERY) as usize);
        let mut previous: Option<[u8; KEY_BYTES + 16]> = None;
        let mut at = 0u64;
        while at < count {
            let n = (count - at).min(OPEN_READ_ENTRIES as u64) as usize;
            let bytes = read(n * ENTRY_BYTES, &mut hasher)?;
            for entry in bytes.chunks_exact(ENTRY_BYTES) {
                let slot = u32::from_le_bytes(entry[33..37].try_into().expect("4 bytes"));
                let Some(pack) = packs.get(slot as usize) else {
                    return Err(format!("entry {at} names slot {slot} of {pack_count}"));
                };
                if !matches!(entry[32], KIND_BLOCK | KIND_TREE) {
                    return Err(format!("entry {at}: unknown kind {}", entry[32]));
                }
                let mut order = [0u8; KEY_BYTES + 16];
                order[..KEY_BYTES].copy_from_slice(&entry[..KEY_BYTES]);
                order[KEY_BYTES..].copy_from_slice(&pack.0);
                if previous.is_some_and(|p| p >= order) {
                    return Err(format!("entry {at} out of order"));
                }
                previous = Some(order);
                fanout[entry[0] as usize] += 1;
                if at.is_multiple_of(SAMPLE_EVERY) {
                    samples.push(prefix_of(entry));
                }
                at += 1;
            }
        }
        for i in 1..256 {
            fanout[i] += fanout[i - 1];
        }
        let stored_fanout = read(FANOUT_BYTES, &mut hasher)?;
        for (i, bytes) in stored_fanout.chunks_exact(8).enumerate() {
            if u64::from_le_bytes(bytes.try_into().expect("8 bytes")) != fanout[i] {
                return Err(format!("fanout entry {i} does not count the entries"));
            }
        }
        let stored_count = u64::from_le_bytes(read(8, &mut hasher)?.try_into().expect("8 bytes"));
        if stored_count != count {
            return Err(format!("says {stored_count} entries, holds {count}"));
        }
        // The checksum itself is not part of what it sums.
        let checksum = read(32, &mut blake3::Hasher::new())?;
        if hasher.finalize().as_bytes() != checksum.as_slice() {
            return Err("checksum mismatch (torn or altered file)".to_owned());
        }
        Ok(Some(MergedIndex {
            file,
            path: path.to_owned(),
            packs,
            count,
            entries_at,
            fanout,
            samples,
        }))
    }

    /// The packs it indexes, ascending.
    pub fn packs(&self) -> &[PackId] {
        &self.packs
    }

    pub fn has_pack(&self, pack: &PackId) -> bool {
        self.packs.binary_search(pack).is_ok()
    }

    /// Entries (objects stored twice count twice).
    pub fn len(&self) -> u64 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where `object` is (its first entry), by one positioned read.
    pub fn lookup(&self, object: &ObjectId) -> std::io::Result<Option<Location>> {
        let key = key_of(object);
        let prefix = prefix_of(&key);
        // The fanout bounds the entries with this first byte; the samples
        // inside it bound the block of entries holding the key.
        let bucket = key[0] as usize;
        let first_entry = if bucket == 0 {
            0
        } else {
            self.fanout[bucket - 1]
        };
        let end_entry = self.fanout[bucket];
        if first_entry == end_entry {
            return Ok(None);
        }
        let samples_from = (first_entry / SAMPLE_EVERY) as usize;
        let samples_to = (end_entry.div_ceil(SAMPLE_EVERY) as usize).min(self.samples.len());
        let within = &self.samples[samples_from..samples_to];
        // The key is in a block whose first key is <= it and whose next
        // block's first key is >= it (equal prefixes may span blocks).
        let lo = samples_from + within.partition_point(|s| *s < prefix).saturating_sub(1);
        let hi = samples_from + within.partition_point(|s| *s <= prefix);
        if hi <= lo {
            return Ok(None);
        }
        let from = (lo as u64 * SAMPLE_EVERY).max(first_entry);
        let to = (hi as u64 * SAMPLE_EVERY).min(end_entry);
        if to <= from {
            return Ok(None);
        }
        let n = (to - from) as usize;
        // One block (the usual case) is read onto the stack.
        let mut block = [0u8; SAMPLE_EVERY as usize * ENTRY_BYTES];
        let mut blocks = Vec::new();
        let bytes: &mut [u8] = if n <= SAMPLE_EVERY as usize {
            &mut block[..n * ENTRY_BYTES]
        } else {
            blocks.resize(n * ENTRY_BYTES, 0);
            &mut blocks
        };
        self.file
            .read_exact_at(bytes, self.entries_at + from * ENTRY_BYTES as u64)?;
        let entry_at = |i: usize| &bytes[i * ENTRY_BYTES..(i + 1) * ENTRY_BYTES];
        let (mut low, mut high) = (0, n);
        while low < high {
            let middle = (low + high) / 2;
            if entry_at(middle)[..KEY_BYTES] < key[..] {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        if low == n || entry_at(low)[..KEY_BYTES] != key[..] {
            return Ok(None);
        }
        let entry = entry_at(low);
        let slot = u32::from_le_bytes(entry[33..37].try_into().expect("4 bytes"));
        let pack = *self.packs.get(slot as usize).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("merged index entry names slot {slot}"),
            )
        })?;
        Ok(Some(Location {
            pack,
            offset: u64::from_le_bytes(entry[37..45].try_into().expect("8 bytes")),
            length: u32::from_le_bytes(entry[45..49].try_into().expect("4 bytes")),
        }))
    }

    /// Its entries in order, those of packs `keep` accepts only.
    fn run<'a>(&'a self, keep: &'a dyn Fn(&PackId) -> bool) -> FileRun<'a> {
        FileRun {
            index: self,
            reader: BufReader::with_capacity(
                64 * 1024,
                PositionedReader::new(&self.file, self.entries_at),
            ),
            left: self.count,
            keep,
        }
    }
}

/// Reads a file from a position of its own by positioned reads, so
/// lookups through the same handle are never disturbed.
struct PositionedReader<'a> {
    file: &'a File,
    at: u64,
}

impl<'a> PositionedReader<'a> {
    fn new(file: &'a File, at: u64) -> PositionedReader<'a> {
        PositionedReader { file, at }
    }
}

impl Read for PositionedReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// A sorted source of entries.
trait Run {
    fn next_entry(&mut self) -> std::io::Result<Option<RunEntry>>;
}

struct FileRun<'a> {
    index: &'a MergedIndex,
    reader: BufReader<PositionedReader<'a>>,
    left: u64,
    keep: &'a dyn Fn(&PackId) -> bool,
}

impl Run for FileRun<'_> {
    fn next_entry(&mut self) -> std::io::Result<Option<RunEntry>> {
        let mut entry = [0u8; ENTRY_BYTES];
        while self.left > 0 {
            self.left -= 1;
            self.reader.read_exact(&mut entry)?;
            let slot = u32::from_le_bytes(entry[33..37].try_into().expect("4 bytes"));
            let Some(pack) = self.index.packs.get(slot as usize) else {
                continue;
            };
            if !(self.keep)(pack) {
                continue;
            }
            return Ok(Some(RunEntry {
                key: entry[..KEY_BYTES].try_into().expect("key"),
                pack: *pack,
                offset: u64::from_le_bytes(entry[37..45].try_into().expect("8 bytes")),
                length: u32::from_le_bytes(entry[45..49].try_into().expect("4 bytes")),
            }));
        }
        Ok(None)
    }
}

struct SpillRun {
    reader: BufReader<File>,
    left: usize,
}

impl Run for SpillRun {
    fn next_entry(&mut self) -> std::io::Result<Option<RunEntry>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        let mut bytes = [0u8; SPILL_ENTRY_BYTES];
        self.reader.read_exact(&mut bytes)?;
        Ok(Some(RunEntry {
            key: bytes[..KEY_BYTES].try_into().expect("key"),
            pack: PackId(bytes[33..49].try_into().expect("pack")),
            offset: u64::from_le_bytes(bytes[49..57].try_into().expect("8 bytes")),
            length: u32::from_le_bytes(bytes[57..61].try_into().expect("4 bytes")),
        }))
    }
}

struct MemoryRun(std::vec::IntoIter<RunEntry>);

impl Run for MemoryRun {
    fn next_entry(&mut self) -> std::io::Result<Option<RunEntry>> {
        Ok(self.0.next())
    }
}

/// Builds a merged index: add the packs' indexes, then [`Builder::finish`].
pub struct Builder {
    dir: PathBuf,
    chunk: Vec<RunEntry>,
    spilled: Vec<SpillRun>,
    packs: Vec<PackId>,
    /// [`CHUNK_ENTRIES`]; smaller in tests, to spill.
    chunk_entries: usize,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn temp_path(dir: &Path, what: &str) -> PathBuf {
    dir.join(format!(
        "{what}.{}.{}.tmp",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

impl Builder {
    /// A builder writing into `dir` (created if need be).
    pub fn new(dir: &Path) -> std::io::Result<Builder> {
        std::fs::create_dir_all(dir)?;
        Ok(Builder {
            dir: dir.to_owned(),
            chunk: Vec::new(),
            spilled: Vec::new(),
            packs: Vec::new(),
            chunk_entries: CHUNK_ENTRIES,
        })
    }

    pub fn add(&mut self, index: &PackIndex) -> std::io::Result<()> {
        self.packs.push(index.pack);
        for entry in &index.entries {
            self.chunk.push(RunEntry {
                key: key_of(&entry.object),
                pack: index.pack,
                offset: entry.offset,
                length: entry.length,
            });
            if self.chunk.len() >= self.chunk_entries {
                self.spill()?;
            }
        }
        Ok(())
    }

    /// Sorts the chunk into a temporary file, unlinked at once (nothing
    /// is left behind by a crash).
    fn spill(&mut self) -> std::io::Result<()> {
        self.chunk.sort_unstable();
        let path = temp_path(&self.dir, "spill");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        let _ = std::fs::remove_file(&path);
        let mut writer = BufWriter::with_capacity(64 * 1024, file);
        for entry in &self.chunk {
            writer.write_all(&entry.key)?;
            writer.write_all(&entry.pack.0)?;
            writer.write_all(&entry.offset.to_le_bytes())?;
            writer.write_all(&entry.length.to_le_bytes())?;
        }
        let mut file = writer.into_inner().map_err(|e| e.into_error())?;
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0))?;
        self.spilled.push(SpillRun {
            reader: BufReader::with_capacity(64 * 1024, file),
            left: self.chunk.len(),
        });
        self.chunk.clear();
        Ok(())
    }

    /// Merges `previous` (its entries of packs `keep` accepts) with every
    /// index added into `dir`/[`FILE_NAME`], replaced atomically (readers
    /// holding the old file keep reading it), and returns it opened.
    pub fn finish(
        mut self,
        org: &OrgId,
        previous: Option<&MergedIndex>,
        keep: &dyn Fn(&PackId) -> bool,
    ) -> std::io::Result<MergedIndex> {
        self.chunk.sort_unstable();
        let mut packs = std::mem::take(&mut self.packs);
        if let Some(previous) = previous {
            packs.extend(previous.packs.iter().filter(|p| keep(p)));
        }
        packs.sort_unstable();
        packs.dedup();
        let mut runs: Vec<Box<dyn Run + '_>> = Vec::new();
        if let Some(previous) = previous {
            runs.push(Box::new(previous.run(keep)));
        }
        for run in std::mem::take(&mut self.spilled) {
            runs.push(Box::new(run));
        }
        runs.push(Box::new(MemoryRun(
            std::mem::take(&mut self.chunk).into_iter(),
        )));

        let path = self.dir.join(FILE_NAME);
        let temp = temp_path(&self.dir, FILE_NAME);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&temp)?;
        let written = write_merged(&file, org, &packs, runs);
        let (count, fanout, samples, entries_at) = match written {
            Ok(done) => done,
            Err(err) => {
                let _ = std::fs::remove_file(&temp);
                return Err(err);
            }
        };
        if let Err(err) = std::fs::rename(&temp, &path) {
            let _ = std::fs::remove_file(&temp);
            return Err(err);
        }
        Ok(MergedIndex {
            file,
            path,
            packs,
            count,
            entries_at,
            fanout,
            samples,
        })
    }
}

type Written = (u64, Box<[u64; 256]>, Vec<u64>, u64);

/// Writes the merged file; returns its count, fanout, samples and where
/// its entries start.
fn write_merged(
    file: &File,
    org: &OrgId,
    packs: &[PackId],
    mut runs: Vec<Box<dyn Run + '_>>,
) -> std::io::Result<Written> {
    let mut out = Hashing {
        writer: BufWriter::with_capacity(256 * 1024, file),
        hasher: blake3::Hasher::new(),
    };
    let org_bytes = org.as_str().as_bytes();
    out.write_all(MAGIC)?;
    out.write_all(&[VERSION, org_bytes.len() as u8])?;
    out.write_all(org_bytes)?;
    out.write_all(&(packs.len() as u32).to_le_bytes())?;
    for pack in packs {
        out.write_all(&pack.0)?;
    }
    let entries_at = 7 + org_bytes.len() as u64 + 4 + 16 * packs.len() as u64;

    let mut heap: BinaryHeap<Reverse<(RunEntry, usize)>> = BinaryHeap::new();
    for (i, run) in runs.iter_mut().enumerate() {
        if let Some(entry) = run.next_entry()? {
            heap.push(Reverse((entry, i)));
        }
    }
    let mut fanout = Box::new([0u64; 256]);
    let mut samples = Vec::new();
    let mut count = 0u64;
    let mut previous: Option<RunEntry> = None;
    while let Some(Reverse((entry, i))) = heap.pop() {
        if let Some(next) = runs[i].next_entry()? {
            heap.push(Reverse((next, i)));
        }
        // The same object in the same pack from two runs (a pack both in
        // the previous file and added again) is one entry.
        if previous.is_some_and(|p| p.key == entry.key && p.pack == entry.pack) {
            continue;
        }
        previous = Some(entry);
        let slot = packs
            .binary_search(&entry.pack)
            .map_err(|_| std::io::Error::other("an entry of a pack not in the list"))?;
        let mut bytes = [0u8; ENTRY_BYTES];
        bytes[..KEY_BYTES].copy_from_slice(&entry.key);
        bytes[33..37].copy_from_slice(&(slot as u32).to_le_bytes());
        bytes[37..45].copy_from_slice(&entry.offset.to_le_bytes());
        bytes[45..49].copy_from_slice(&entry.length.to_le_bytes());
        out.write_all(&bytes)?;
        fanout[entry.key[0] as usize] += 1;
        if count.is_multiple_of(SAMPLE_EVERY) {
            samples.push(prefix_of(&entry.key));
        }
        count += 1;
    }
    for i in 1..256 {
        fanout[i] += fanout[i - 1];
    }
    for n in fanout.iter() {
        out.write_all(&n.to_le_bytes())?;
    }
    out.write_all(&count.to_le_bytes())?;
    let checksum = out.hasher.finalize();
    out.writer.write_all(checksum.as_bytes())?;
    out.writer.flush()?;
    Ok((count, fanout, samples, entries_at))
}

/// A writer that hashes what passes through it: a file's checksum
/// trailer computed as the file is written (here and the file index's).
pub(crate) struct Hashing<W: Write> {
    pub writer: W,
    pub hasher: blake3::Hasher,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.writer.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.writer.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Digest;
    use crate::pack::Entry;

    fn org() -> OrgId {
        "acme".parse().expect("org")
    }

    /// `packs` indexes of `per_pack` objects each (not tiling real packs:
    /// the merged index takes entries as its sources give them).
    fn indexes(packs: u8, per_pack: usize) -> Vec<PackIndex> {
        (0..packs)
            .map(|p| PackIndex {
                pack: PackId([p.wrapping_mul(37); 16]),
                pack_bytes: 0,
                born: None,
                entries: (0..per_pack)
                    .map(|i| {
                        let digest = Digest::of(format!("{p} {i}").as_bytes());
                        Entry {
                            object: if i % 3 == 0 {
                                ObjectId::tree(digest)
                            } else {
                                ObjectId::block(digest)
                            },
                            offset: i as u64 * 10,
                            length: p as u32 + 1,
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    fn assert_finds(merged: &MergedIndex, indexes: &[PackIndex]) {
        for index in indexes {
            for entry in &index.entries {
                assert_eq!(
                    merged.lookup(&entry.object).expect("read"),
                    Some(Location {
                        pack: index.pack,
                        offset: entry.offset,
                        length: entry.length,
                    })
                );
                let other = ObjectId::block(Digest::of(&entry.object.digest.0));
                assert_eq!(merged.lookup(&other).expect("read"), None);
            }
        }
    }

    #[test]
    fn a_merge_of_spilled_runs_finds_every_entry_and_reopens_the_same() {
        let dir = tempfile::tempdir().expect("dir");
        let all = indexes(20, 700);
        let mut builder = Builder::new(dir.path()).expect("builder");
        builder.chunk_entries = 999;
        for index in &all {
            builder.add(index).expect("add");
        }
        let merged = builder.finish(&org(), None, &|_| true).expect("merge");
        assert_eq!(merged.len(), 14_000);
        assert_finds(&merged, &all);
        let reopened = MergedIndex::open(merged.path(), &org())
            .expect("sound")
            .expect("there");
        assert_eq!(reopened.samples, merged.samples);
        assert_eq!(reopened.fanout, merged.fanout);
        assert_finds(&reopened, &all);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(leftovers, [FILE_NAME], "spills and temporary files gone");
    }

    #[test]
    fn a_rebuild_drops_the_packs_not_kept_and_keeps_second_copies() {
        let dir = tempfile::tempdir().expect("dir");
        let all = indexes(6, 300);
        let mut builder = Builder::new(dir.path()).expect("builder");
        for index in &all[..4] {
            builder.add(index).expect("add");
        }
        // Pack 4 holds copies of pack 0's objects.
        let copies = PackIndex {
            pack: PackId([200; 16]),
            ..all[0].clone()
        };
        builder.add(&copies).expect("add");
        let first = builder.finish(&org(), None, &|_| true).expect("merge");
        assert_eq!(first.len(), 1_500);
        // Pack 0 gone: its objects are found in their second copy; pack 5
        // added.
        let mut builder = Builder::new(dir.path()).expect("builder");
        builder.add(&all[5]).expect("add");
        let gone = all[0].pack;
        let second = builder
            .finish(&org(), Some(&first), &|pack| *pack != gone)
            .expect("rebuild");
        assert_eq!(second.len(), 1_500);
        assert!(!second.has_pack(&gone));
        assert_finds(&second, &[copies]);
        assert_finds(&second, &all[1..4]);
        assert_finds(&second, &all[5..]);
        // The first stays readable through its open handle.
        assert_finds(&first, &all[..4]);
    }

    #[test]
    fn opening_refuses_a_damaged_or_foreign_file() {
        let dir = tempfile::tempdir().expect("dir");
        let mut builder = Builder::new(dir.path()).expect("builder");
        for index in &indexes(3, 100) {
            builder.add(index).expect("add");
        }
        let merged = builder.finish(&org(), None, &|_| true).expect("merge");
        let path = merged.path().to_owned();
        let good = std::fs::read(&path).expect("read");
        let refused = |bytes: &[u8], org_name: &str| {
            std::fs::write(&path, bytes).expect("write");
            MergedIndex::open(&path, &org_name.parse().expect("org")).expect_err("refused")
        };
        assert!(refused(&good, "other").contains("org \"acme\""));
        for at in [0, 5, 20, good.len() / 2, good.len() - 40, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 1;
            refused(&bad, "acme");
        }
        refused(&good[..good.len() - 49], "acme");
        refused(&good[..10], "acme");
        refused(b"", "acme");
        std::fs::remove_file(&path).expect("remove");
        assert!(MergedIndex::open(&path, &org()).expect("absent").is_none());
    }
}
