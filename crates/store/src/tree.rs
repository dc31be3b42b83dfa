//! Directory objects: the nodes of a home's Merkle tree.
//!
//! Encoding, version 1 (all integers little-endian):
//!
//! ```text
//! magic "RTREE" · version u8 = 1 · entry count u32
//! per entry, strictly ascending by name bytes:
//!   kind u8 (1 file, 2 dir, 3 symlink) · name length u16 · name bytes
//!   mode u32 (permission bits only; see below) · size u64 · mtime_ns i64
//!   file:    block count u32 · 32-byte digests
//!   dir:     32-byte digest of the subtree
//!   symlink: target length u16 · target bytes
//! ```
//!
//! `size` is the file length, the symlink target length, or for a
//! directory the total file bytes beneath it (so a root knows its logical
//! size). The same tree always encodes to the same bytes, so the root
//! digest is the same on every machine. Decoding checks everything a
//! hostile store could lie about: names, order, counts, lengths.
//!
//! # No setuid or setgid
//!
//! A mode carries permission bits and the sticky bit, never setuid or
//! setgid ([`SETID_BITS`]): trees are tenant content that the runner
//! writes on its host as root, and a stored `04755` copy of a shell would
//! be a setuid-root program there. So the rule is, in one place each:
//! - [`Tree::encode`] refuses such a mode, and the scan that builds every
//!   tree a client uploads (`home push`, the runner's saves, image import)
//!   strips the bits first ([`stored_mode`]), logging once that it did;
//! - the block service and [`crate::objects::put_tree_checked`] refuse an
//!   uploaded tree naming one ([`check_no_setid`]), a 400 naming the entry;
//! - pull writes [`stored_mode`] of whatever a tree says, so a tree stored
//!   before this rule (decoding still accepts it, so such homes stay
//!   readable) never restores the bits either.
//!
//! Stripping rather than refusing at the client because a home with a
//! setuid file in it (a copied `/usr/bin/sudo`) is ordinary, and refusing
//! the push would lose the rest of the home; refusing rather than
//! stripping at the store because a client that sends the bits anyway did
//! not run our scan, and silently storing something else than the bytes
//! it named would break content addressing.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::os::unix::ffi::OsStrExt;

use crate::block::block_count;
use crate::{Digest, Error, Result};

const MAGIC: &[u8; 5] = b"RTREE";
const VERSION: u8 = 1;
const KIND_FILE: u8 = 1;
const KIND_DIR: u8 = 2;
const KIND_SYMLINK: u8 = 3;
pub const NAME_BYTES_MAX: usize = 255;
pub const SYMLINK_TARGET_BYTES_MAX: usize = 4095;
/// Bits a decoded mode may have (older trees may carry [`SETID_BITS`]).
pub const MODE_MASK: u32 = 0o7777;
/// setuid and setgid: never stored by this client, refused at upload,
/// never written by pull (see the module documentation).
pub const SETID_BITS: u32 = 0o6000;
/// Bounds a hostile tree; a real directory with more entries is refused at scan.
pub const ENTRIES_MAX: usize = 1 << 20;
/// The most a tree object's encoding may be: what a pack entry holds and a
/// zstd frame decodes to ([`crate::block::SINGLE_BLOCK_BYTES_MAX`]).
/// [`Tree::encode`] refuses more, so scan never makes a tree no store can
/// hand back (one directory of some 100,000 files, by their names).
pub const TREE_BYTES_MAX: u64 = crate::block::SINGLE_BLOCK_BYTES_MAX;
/// Directories nested below a root, at most: scan refuses a deeper
/// directory and pull a deeper tree ([`Error::TooDeep`]), so whatever is
/// pushed can be pulled. Real homes nest a few dozen levels (paths stop
/// fitting `PATH_MAX`, 4096 bytes, long before 256 levels of ordinary
/// names); pull writes a level with a directory handle and a few stack
/// frames each, and 256 of them stay well within a 2 MiB thread stack and
/// the usual 1024 open files. Every other walk over trees is iterative and
/// needs no bound.
pub const DEPTH_MAX: usize = 256;
/// Entries a tree may expand to (files, directories and symlinks, a
/// shared subtree counted each time it appears): a few million, more than
/// any home we have seen (a large one holds about a million), and what a
/// runner can write out in reasonable time. Without it a few kilobytes of
/// trees naming one subtree many times expand to billions of files.
pub const EXPANDED_ENTRIES_MAX: u64 = 1 << 22;
/// The largest file a home may hold: 512 GiB, refused by scan before a
/// byte of it is read ([`Error::FileTooLarge`]). A file's entry lists a
/// 32-byte digest per 4 MiB block, and a tree object holds at most 8 MiB
/// (what a pack entry holds and a zstd frame decodes to:
/// [`crate::block::SINGLE_BLOCK_BYTES_MAX`]), so no tree can hold a file
/// past about 1 TiB (262,135 blocks); 512 GiB takes half a tree's room,
/// leaving the rest to its directory's other entries. Without the bound a
/// sparse file (`truncate -s 8E`) was hashed hole by hole, for ever, and
/// one past 1 TiB could only fail once read whole.
pub const FILE_BYTES_MAX: u64 = 512 << 30;
/// File bytes a tree may expand to (every file's size, a shared subtree
/// counted each time it appears): 4 TiB. The largest homes and images we
/// run hold tens of gigabytes and a runner's disk a few terabytes, so no
/// real home comes near; without it a few kilobytes of trees (one file of
/// 200,000 blocks of one digest, under a chain of directories each naming
/// the one below twice) expand to exabytes. It also caps what large files
/// add to [`EXPANDED_BLOCK_REFS_MAX`]: 4 TiB is 2^20 blocks of 4 MiB.
pub const EXPANDED_FILE_BYTES_MAX: u64 = 4 << 40;
/// Block references a tree may expand to (every file's block list, a
/// shared subtree counted each time it appears): 4 Mi. A home's files
/// reference one block each up to 8 MiB, one per 4 MiB above, so a home
/// within the other bounds references about its file count plus 2^20;
/// 4 Mi is as many as [`EXPANDED_ENTRIES_MAX`] allows files.
///
/// A pull's memory budget for block references at the bound is 1 GiB: it
/// holds at most about 256 bytes per reference (an empty directory's pull
/// from a store a round trip away keeps each reference's place, 24 bytes,
/// and per distinct block a map slot, its place in the fetch order and its
/// window, about 200; every pull keeps each file's block list for the new
/// file index, 32 bytes a reference), and 4 Mi × 256 bytes is 1 GiB.
pub const EXPANDED_BLOCK_REFS_MAX: u64 = 1 << 22;
/// Bytes the distinct trees of a tree may encode to, together: 1 GiB. A
/// pull holds every tree before it writes (decoded: this, and about 100
/// bytes an entry more), and trees are shared, so nothing else bounds it:
/// decoded trees are up to 8 MiB each, and a few million distinct ones
/// (4 KiB symlink targets, 8 MiB block lists) compress to little in the
/// store. A real home's trees take about 100 bytes an entry (name, times,
/// one digest), so a home at [`EXPANDED_ENTRIES_MAX`] needs about 400 MiB.
pub const DISTINCT_TREE_BYTES_MAX: u64 = 1 << 30;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryKind {
    File { blocks: Vec<Digest> },
    Dir { tree: Digest },
    Symlink { target: Vec<u8> },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: Vec<u8>,
    pub mode: u32,
    pub size: u64,
    pub mtime_ns: i64,
    pub kind: EntryKind,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tree {
    pub entries: Vec<Entry>,
}

/// Whether `name` may appear as one component of a home path.
pub fn is_valid_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && name != b"."
        && name != b".."
        && !name.iter().any(|&b| b == b'/' || b == 0)
}

/// The mode a tree stores and pull writes for a file whose mode is
/// `mode`: permissions and the sticky bit, without setuid or setgid.
pub fn stored_mode(mode: u32) -> u32 {
    mode & MODE_MASK & !SETID_BITS
}

/// Refuses a tree naming a setuid or setgid mode: what the block service
/// and [`crate::objects::put_tree_checked`] check of an uploaded tree.
/// The error names the first such entry.
pub fn check_no_setid(digest: &Digest, tree: &Tree) -> Result<()> {
    match tree.entries.iter().find(|e| e.mode & SETID_BITS != 0) {
        None => Ok(()),
        Some(entry) => Err(Error::MalformedTree {
            digest: *digest,
            reason: setid_refused(entry),
        }),
    }
}

fn setid_refused(entry: &Entry) -> String {
    format!(
        "entry {:?} has mode {:04o}: trees do not carry setuid or setgid bits (clear them, mode & 0o1777, before uploading)",
        String::from_utf8_lossy(&entry.name),
        entry.mode
    )
}

/// File bytes described by `entries`: file sizes, plus the totals that
/// directory entries carry; symlinks count nothing. Saturates rather than
/// wraps; a tree whose sizes would not fit is refused by
/// [`Tree::decode`] and [`Tree::encode`] ([`checked_logical_bytes`]).
pub fn logical_bytes(entries: &[Entry]) -> u64 {
    checked_logical_bytes(entries).unwrap_or(u64::MAX)
}

/// [`logical_bytes`], or `None` when the sum passes `u64::MAX`.
pub fn checked_logical_bytes(entries: &[Entry]) -> Option<u64> {
    entries
        .iter()
        .filter(|e| !matches!(e.kind, EntryKind::Symlink { .. }))
        .try_fold(0u64, |sum, e| sum.checked_add(e.size))
}

impl Tree {
    /// Sorts entries and encodes. Panics never; refuses invalid names so a
    /// tree we write can always be read back.
    pub fn encode(mut self) -> Result<(Digest, Vec<u8>)> {
        self.entries.sort_by(|a, b| a.name.cmp(&b.name));
        for pair in self.entries.windows(2) {
            if pair[0].name == pair[1].name {
                return Err(invalid_entry(&pair[0].name, "duplicate name"));
            }
        }
        for entry in &self.entries {
            if !is_valid_name(&entry.name) {
                return Err(invalid_entry(&entry.name, "invalid name"));
            }
            if entry.mode & !MODE_MASK != 0 {
                return Err(invalid_entry(
                    &entry.name,
                    "mode has bits beyond permissions",
                ));
            }
            if entry.mode & SETID_BITS != 0 {
                return Err(Error::MalformedTree {
                    digest: Digest([0; 32]),
                    reason: setid_refused(entry),
                });
            }
            if let EntryKind::Symlink { target } = &entry.kind
                && (target.is_empty()
                    || target.len() > SYMLINK_TARGET_BYTES_MAX
                    || target.contains(&0))
            {
                return Err(invalid_entry(&entry.name, "invalid symlink target"));
            }
        }
        if checked_logical_bytes(&self.entries).is_none() {
            return Err(Error::MalformedTree {
                digest: Digest([0; 32]),
                reason: "entry sizes overflow 64 bits".to_owned(),
            });
        }
        let bytes = self.encode_unchecked();
        if bytes.len() as u64 > TREE_BYTES_MAX {
            return Err(Error::MalformedTree {
                digest: Digest([0; 32]),
                reason: format!(
                    "the directory's listing encodes to {} bytes, more than the {TREE_BYTES_MAX} a tree holds: split the directory",
                    bytes.len()
                ),
            });
        }
        Ok((Digest::of(&bytes), bytes))
    }

    /// Encodes entries exactly as given, valid or not. Tests use it to
    /// craft hostile trees; production code calls [`Tree::encode`].
    #[doc(hidden)]
    pub fn encode_unchecked(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.entries.len() * 64);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for entry in &self.entries {
            let kind = match entry.kind {
                EntryKind::File { .. } => KIND_FILE,
                EntryKind::Dir { .. } => KIND_DIR,
                EntryKind::Symlink { .. } => KIND_SYMLINK,
            };
            out.push(kind);
            out.extend_from_slice(&(entry.name.len() as u16).to_le_bytes());
            out.extend_from_slice(&entry.name);
            out.extend_from_slice(&entry.mode.to_le_bytes());
            out.extend_from_slice(&entry.size.to_le_bytes());
            out.extend_from_slice(&entry.mtime_ns.to_le_bytes());
            match &entry.kind {
                EntryKind::File { blocks } => {
                    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
                    for block in blocks {
                        out.extend_from_slice(&block.0);
                    }
                }
                EntryKind::Dir { tree } => out.extend_from_slice(&tree.0),
                EntryKind::Symlink { target } => {
                    out.extend_from_slice(&(target.len() as u16).to_le_bytes());
                    out.extend_from_slice(target);
                }
            }
        }
        out
    }

    /// Decodes and validates a tree object whose digest was already checked.
    pub fn decode(digest: &Digest, bytes: &[u8]) -> Result<Tree> {
        let malformed = |reason: &str| Error::MalformedTree {
            digest: *digest,
            reason: reason.to_owned(),
        };
        let mut reader = Reader { bytes, at: 0 };
        if reader
            .take(MAGIC.len())
            .ok_or_else(|| malformed("truncated"))?
            != MAGIC
        {
            return Err(malformed("bad magic"));
        }
        let version = reader.u8().ok_or_else(|| malformed("truncated"))?;
        if version != VERSION {
            return Err(malformed(&format!("unsupported version {version}")));
        }
        let count = reader.u32().ok_or_else(|| malformed("truncated"))? as usize;
        if count > ENTRIES_MAX {
            return Err(malformed("too many entries"));
        }
        let mut entries: Vec<Entry> = Vec::with_capacity(count.min(4096));
        for _ in 0..count {
            let entry = reader.entry().ok_or_else(|| malformed("truncated entry"))?;
            if !is_valid_name(&entry.name) {
                return Err(malformed(&format!(
                    "invalid entry name {:?}",
                    String::from_utf8_lossy(&entry.name)
                )));
            }
            if let Some(previous) = entries.last()
                && previous.name >= entry.name
            {
                return Err(malformed("entries not strictly sorted (duplicate name?)"));
            }
            if entry.mode & !MODE_MASK != 0 {
                return Err(malformed("mode has bits beyond permissions"));
            }
            match &entry.kind {
                EntryKind::File { blocks } => {
                    if blocks.len() as u64 != block_count(entry.size) {
                        return Err(malformed("block count does not match file size"));
                    }
                }
                EntryKind::Symlink { target } => {
                    // The length field allows 65,535 bytes; `encode` (and
                    // the kernel) stop at the bound, so a longer target
                    // could be read but never written back.
                    if target.is_empty()
                        || target.len() > SYMLINK_TARGET_BYTES_MAX
                        || target.contains(&0)
                    {
                        return Err(malformed("invalid symlink target"));
                    }
                }
                EntryKind::Dir { .. } => {}
            }
            entries.push(entry);
        }
        if reader.at != bytes.len() {
            return Err(malformed("trailing bytes"));
        }
        // A directory's logical size is the sum of these: one that wraps
        // would make every total above it a lie.
        if checked_logical_bytes(&entries).is_none() {
            return Err(malformed("entry sizes overflow 64 bits"));
        }
        Ok(Tree { entries })
    }
}

/// A value for every node reachable from `roots` in a DAG, each computed by
/// `combine(node, its children's values)` after all of its children's, in
/// an explicit stack rather than by recursion: a chain of a million trees
/// costs memory, not the thread's stack. `children` is asked once per
/// node; a child named several times is in the slice as often. A node met
/// again on its own path (impossible with content addressing, but cheap
/// to refuse) is left out of its parent's values.
pub(crate) fn fold_bottom_up<K, V>(
    roots: impl IntoIterator<Item = K>,
    mut children: impl FnMut(&K) -> Vec<K>,
    mut combine: impl FnMut(&K, &[V]) -> V,
) -> HashMap<K, V>
where
    K: Clone + Eq + Hash,
    V: Clone,
{
    let mut done: HashMap<K, V> = HashMap::new();
    let mut on_path: HashSet<K> = HashSet::new();
    for root in roots {
        if done.contains_key(&root) {
            continue;
        }
        on_path.insert(root.clone());
        let kids = children(&root);
        // (node, its children, how many of them were looked at)
        let mut stack: Vec<(K, Vec<K>, usize)> = vec![(root, kids, 0)];
        while let Some(top) = stack.len().checked_sub(1) {
            let (_, kids, next) = &mut stack[top];
            if let Some(kid) = kids.get(*next).cloned() {
                *next += 1;
                if !done.contains_key(&kid) && on_path.insert(kid.clone()) {
                    let grandkids = children(&kid);
                    stack.push((kid, grandkids, 0));
                }
                continue;
            }
            if let Some((node, kids, _)) = stack.pop() {
                let values: Vec<V> = kids.iter().filter_map(|k| done.get(k).cloned()).collect();
                let value = combine(&node, &values);
                on_path.remove(&node);
                done.insert(node, value);
            }
        }
    }
    done
}

/// What a tree expands to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extent {
    /// Directories nested below it on its deepest path (0: no subdirectory).
    pub height: usize,
    /// Entries under it, a shared subtree counted each time it appears.
    pub entries: u64,
    /// Its files' sizes, summed the same way (saturating). Taken from the
    /// file entries, never from the totals directory entries declare.
    pub file_bytes: u64,
    /// Its files' block references, summed the same way (saturating).
    pub block_refs: u64,
}

impl Extent {
    /// The extent of a directory holding `entries`, whose subdirectories'
    /// extents are `children` (one per directory entry).
    pub fn of(entries: &[Entry], children: &[Extent]) -> Extent {
        let mut own = Extent {
            entries: entries.len() as u64,
            ..Extent::default()
        };
        for entry in entries {
            if let EntryKind::File { blocks } = &entry.kind {
                own.file_bytes = own.file_bytes.saturating_add(entry.size);
                own.block_refs = own.block_refs.saturating_add(blocks.len() as u64);
            }
        }
        children.iter().fold(own, |sum, child| {
            sum.plus(Extent {
                height: child.height.saturating_add(1),
                ..*child
            })
        })
    }

    /// Both together: the sums, and the greater height.
    pub fn plus(self, other: Extent) -> Extent {
        Extent {
            height: self.height.max(other.height),
            entries: self.entries.saturating_add(other.entries),
            file_bytes: self.file_bytes.saturating_add(other.file_bytes),
            block_refs: self.block_refs.saturating_add(other.block_refs),
        }
    }

    /// Refuses an extent past [`EXPANDED_ENTRIES_MAX`],
    /// [`EXPANDED_FILE_BYTES_MAX`] or [`EXPANDED_BLOCK_REFS_MAX`], the
    /// error naming the bound and `what()` (the tree or the directory).
    /// The height is the caller's to check: its error names a path.
    pub fn check(&self, what: impl Fn() -> String) -> Result<()> {
        if self.entries > EXPANDED_ENTRIES_MAX {
            return Err(Error::TooManyEntries {
                what: what(),
                entries_max: EXPANDED_ENTRIES_MAX,
            });
        }
        if self.file_bytes > EXPANDED_FILE_BYTES_MAX {
            return Err(Error::TooManyFileBytes {
                what: what(),
                file_bytes_max: EXPANDED_FILE_BYTES_MAX,
            });
        }
        if self.block_refs > EXPANDED_BLOCK_REFS_MAX {
            return Err(Error::TooManyBlockRefs {
                what: what(),
                block_refs_max: EXPANDED_BLOCK_REFS_MAX,
            });
        }
        Ok(())
    }
}

/// Refuses distinct trees encoding to more than [`DISTINCT_TREE_BYTES_MAX`]
/// together (`tree_bytes`), the error naming `what()`.
pub fn check_tree_bytes(tree_bytes: u64, what: impl Fn() -> String) -> Result<()> {
    if tree_bytes > DISTINCT_TREE_BYTES_MAX {
        return Err(Error::TooManyTreeBytes {
            what: what(),
            tree_bytes_max: DISTINCT_TREE_BYTES_MAX,
        });
    }
    Ok(())
}

/// The length of `tree`'s encoding (what [`Tree::encode`] writes), by
/// arithmetic.
pub fn encoded_len(tree: &Tree) -> u64 {
    let header = (MAGIC.len() + 1 + 4) as u64;
    tree.entries.iter().fold(header, |sum, entry| {
        let fixed = 1 + 2 + entry.name.len() + 4 + 8 + 8;
        let kind = match &entry.kind {
            EntryKind::File { blocks } => 4 + 32 * blocks.len(),
            EntryKind::Dir { .. } => 32,
            EntryKind::Symlink { target } => 2 + target.len(),
        };
        sum.saturating_add((fixed + kind) as u64)
    })
}

/// Refuses the tree `root` (its trees all in `trees`; one absent counts as
/// empty) if it nests deeper than [`DEPTH_MAX`] ([`Error::TooDeep`], with
/// the path of a directory past the bound), expands past
/// [`EXPANDED_ENTRIES_MAX`] entries, [`EXPANDED_FILE_BYTES_MAX`] file
/// bytes or [`EXPANDED_BLOCK_REFS_MAX`] block references
/// ([`Extent::check`]), or its distinct trees encode to more than
/// [`DISTINCT_TREE_BYTES_MAX`]. Iterative and linear in the distinct
/// trees, however large the expansion.
pub fn check_bounds(root: &Digest, trees: &HashMap<Digest, Tree>) -> Result<Extent> {
    let subtrees = |digest: &Digest| -> Vec<Digest> {
        trees.get(digest).map_or_else(Vec::new, |tree| {
            tree.entries
                .iter()
                .filter_map(|e| match &e.kind {
                    EntryKind::Dir { tree } => Some(*tree),
                    _ => None,
                })
                .collect()
        })
    };
    let extents = fold_bottom_up([*root], subtrees, |digest, children: &[Extent]| {
        let entries = trees.get(digest).map_or(&[][..], |t| &t.entries[..]);
        Extent::of(entries, children)
    });
    let extent = extents.get(root).copied().unwrap_or_default();
    if extent.height > DEPTH_MAX {
        // Name a directory past the bound: follow the deepest path down.
        let mut path = std::path::PathBuf::new();
        let mut at = *root;
        for _ in 0..=DEPTH_MAX {
            let height = extents.get(&at).map_or(0, |e| e.height);
            let deepest = trees.get(&at).and_then(|tree| {
                tree.entries.iter().find_map(|e| match &e.kind {
                    EntryKind::Dir { tree }
                        if extents.get(tree).map_or(0, |c| c.height) + 1 == height =>
                    {
                        Some((&e.name, *tree))
                    }
                    _ => None,
                })
            });
            let Some((name, child)) = deepest else { break };
            path.push(std::ffi::OsStr::from_bytes(name));
            at = child;
        }
        return Err(Error::TooDeep {
            path,
            depth_max: DEPTH_MAX,
        });
    }
    let what = || format!("tree {root}");
    extent.check(what)?;
    // The trees the fold reached: the root's, each once.
    let tree_bytes = extents
        .keys()
        .filter_map(|digest| trees.get(digest))
        .fold(0u64, |sum, tree| sum.saturating_add(encoded_len(tree)));
    check_tree_bytes(tree_bytes, what)?;
    Ok(extent)
}

fn invalid_entry(name: &[u8], reason: &str) -> Error {
    Error::MalformedTree {
        digest: Digest([0; 32]),
        reason: format!("{reason}: {:?}", String::from_utf8_lossy(name)),
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(len)?;
        let out = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(out)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn digest(&mut self) -> Option<Digest> {
        Some(Digest(self.take(32)?.try_into().ok()?))
    }
    fn entry(&mut self) -> Option<Entry> {
        let kind = self.u8()?;
        let name_len = usize::from(self.u16()?);
        let name = self.take(name_len)?.to_vec();
        let mode = self.u32()?;
        let size = self.u64()?;
        let mtime_ns = self.u64()? as i64;
        let kind = match kind {
            KIND_FILE => {
                let count = self.u32()? as usize;
                // Each digest needs 32 bytes: a count the buffer cannot hold
                // is rejected before anything is allocated.
                if count > (self.bytes.len() - self.at) / 32 {
                    return None;
                }
                let blocks = (0..count)
                    .map(|_| self.digest())
                    .collect::<Option<Vec<_>>>()?;
                EntryKind::File { blocks }
            }
            KIND_DIR => EntryKind::Dir {
                tree: self.digest()?,
            },
            KIND_SYMLINK => {
                let len = usize::from(self.u16()?);
                EntryKind::Symlink {
                    target: self.take(len)?.to_vec(),
                }
            }
            _ => return None,
        };
        Some(Entry {
            name,
            mode,
            size,
            mtime_ns,
            kind,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::block_ranges;
    use proptest::prelude::*;

    fn file(name: &str, size: u64) -> Entry {
        Entry {
            name: name.as_bytes().to_vec(),
            mode: 0o644,
            size,
            mtime_ns: 1_700_000_000_123_456_789,
            kind: EntryKind::File {
                blocks: block_ranges(size)
                    .map(|(o, _)| Digest::of(&o.to_le_bytes()))
                    .collect(),
            },
        }
    }

    #[test]
    fn encoding_is_deterministic_and_order_independent() {
        let a = Tree {
            entries: vec![file("b", 3), file("a", 0), file("é", 10)],
        };
        let b = Tree {
            entries: vec![file("é", 10), file("b", 3), file("a", 0)],
        };
        let (digest_a, bytes_a) = a.encode().expect("valid");
        let (digest_b, bytes_b) = b.encode().expect("valid");
        assert_eq!(digest_a, digest_b);
        assert_eq!(bytes_a, bytes_b);
        // Pinned: a change to the encoding must bump VERSION, not silently
        // change every root digest.
        let (empty, bytes) = Tree::default().encode().expect("valid");
        assert_eq!(bytes, b"RTREE\x01\x00\x00\x00\x00");
        assert_eq!(empty, Digest::of(b"RTREE\x01\x00\x00\x00\x00"));
    }

    #[test]
    fn hostile_trees_are_refused() {
        for name in ["..", ".", "a/b", "", "/etc"] {
            let bytes = Tree {
                entries: vec![file(name, 1)],
            }
            .encode_unchecked();
            let digest = Digest::of(&bytes);
            assert!(Tree::decode(&digest, &bytes).is_err(), "{name:?}");
        }
        let dup = Tree {
            entries: vec![file("a", 1), file("a", 2)],
        }
        .encode_unchecked();
        assert!(Tree::decode(&Digest::of(&dup), &dup).is_err());
        let mut wrong_count = file("big", 9 * 1024 * 1024);
        wrong_count.kind = EntryKind::File {
            blocks: vec![Digest::of(b"x")],
        };
        let bytes = Tree {
            entries: vec![wrong_count],
        }
        .encode_unchecked();
        assert!(Tree::decode(&Digest::of(&bytes), &bytes).is_err());
        let (_, mut good) = Tree {
            entries: vec![file("a", 1)],
        }
        .encode()
        .expect("valid");
        good.push(0);
        assert!(Tree::decode(&Digest::of(&good), &good).is_err());
        // A huge claimed block count must not allocate.
        let mut huge = b"RTREE\x01\x01\x00\x00\x00\x01\x01\x00a".to_vec();
        huge.extend_from_slice(&[0; 20]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Tree::decode(&Digest::of(&huge), &huge).is_err());
    }

    /// A tree past what a store hands back (a pack entry, a zstd frame:
    /// 8 MiB) is refused where it is made, not stored unreadable: scan
    /// names the directory. Found with the audit's file size bound.
    #[test]
    fn a_tree_past_the_object_bound_is_not_encoded() {
        let blocks = (TREE_BYTES_MAX / 32) as usize;
        let fits = Tree {
            entries: vec![Entry {
                kind: EntryKind::File {
                    blocks: vec![Digest::of(b"b"); blocks - 16],
                },
                size: (blocks as u64 - 16) * crate::block::SPLIT_BLOCK_BYTES,
                ..file("f", 0)
            }],
        };
        let (_, bytes) = fits.encode().expect("under the bound");
        assert!(bytes.len() as u64 <= TREE_BYTES_MAX);
        let past = Tree {
            entries: vec![Entry {
                kind: EntryKind::File {
                    blocks: vec![Digest::of(b"b"); blocks],
                },
                size: blocks as u64 * crate::block::SPLIT_BLOCK_BYTES,
                ..file("f", 0)
            }],
        };
        let err = past.encode().expect_err("past the bound");
        assert!(err.to_string().contains("split the directory"), "{err}");
    }

    /// Issue 14: a tenant's `04755` file must not become a setuid program
    /// on the runner host, so no tree this code writes carries the bits,
    /// and an uploaded one naming them is refused, naming the entry.
    #[test]
    fn setid_modes_are_not_stored() {
        for mode in [0o4755, 0o2755, 0o6777] {
            let mut entry = file("id", 3);
            entry.mode = mode;
            let err = Tree {
                entries: vec![entry.clone()],
            }
            .encode()
            .expect_err("encode refuses setid");
            assert!(err.to_string().contains("\"id\""), "{err}");
            // A tree stored before the rule still decodes (its home stays
            // readable; pull masks the bits), but an upload of it is refused.
            let bytes = Tree {
                entries: vec![entry],
            }
            .encode_unchecked();
            let digest = Digest::of(&bytes);
            let tree = Tree::decode(&digest, &bytes).expect("legacy trees decode");
            let err = check_no_setid(&digest, &tree).expect_err("upload refuses setid");
            assert!(err.to_string().contains("setuid"), "{err}");
            assert_eq!(stored_mode(mode), mode & 0o1777);
        }
        let mut sticky = file("tmp", 0);
        sticky.mode = 0o1777;
        let tree = Tree {
            entries: vec![sticky],
        };
        let (digest, bytes) = tree.clone().encode().expect("sticky is kept");
        check_no_setid(&digest, &Tree::decode(&digest, &bytes).expect("decodes")).expect("allowed");
    }

    fn arb_entry() -> impl Strategy<Value = Entry> {
        let name =
            proptest::collection::vec(1u8..=255, 1..20).prop_filter("valid", |n| is_valid_name(n));
        let kind = prop_oneof![
            (0u64..20_000_000).prop_map(|size| (
                size,
                EntryKind::File {
                    blocks: block_ranges(size)
                        .map(|(o, _)| Digest::of(&o.to_le_bytes()))
                        .collect()
                }
            )),
            any::<[u8; 32]>().prop_map(|d| (5, EntryKind::Dir { tree: Digest(d) })),
            proptest::collection::vec(1u8..=255, 1..100)
                .prop_map(|t| (t.len() as u64, EntryKind::Symlink { target: t })),
        ];
        (name, 0u32..=0o1777, any::<i64>(), kind).prop_map(
            |(name, mode, mtime_ns, (size, kind))| Entry {
                name,
                mode,
                size,
                mtime_ns,
                kind,
            },
        )
    }

    proptest! {
        #[test]
        fn random_trees_round_trip(entries in proptest::collection::vec(arb_entry(), 0..30)) {
            let mut entries = entries;
            entries.sort_by(|a, b| a.name.cmp(&b.name));
            entries.dedup_by(|a, b| a.name == b.name);
            let tree = Tree { entries };
            let (digest, bytes) = tree.clone().encode().expect("valid");
            prop_assert_eq!(encoded_len(&tree), bytes.len() as u64);
            prop_assert_eq!(Tree::decode(&digest, &bytes).expect("decodes"), tree);
        }
    }
}
