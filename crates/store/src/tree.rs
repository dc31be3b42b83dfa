//! Directory objects: the nodes of a home's Merkle tree.
//!
//! Encoding, version 1 (all integers little-endian):
//!
//! ```text
//! magic "RTREE" · version u8 = 1 · entry count u32
//! per entry, strictly ascending by name bytes:
//!   kind u8 (1 file, 2 dir, 3 symlink) · name length u16 · name bytes
//!   mode u32 (permission bits only) · size u64 · mtime_ns i64
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

use crate::block::block_count;
use crate::{Digest, Error, Result};

const MAGIC: &[u8; 5] = b"RTREE";
const VERSION: u8 = 1;
const KIND_FILE: u8 = 1;
const KIND_DIR: u8 = 2;
const KIND_SYMLINK: u8 = 3;
pub const NAME_BYTES_MAX: usize = 255;
pub const SYMLINK_TARGET_BYTES_MAX: usize = 4095;
pub const MODE_MASK: u32 = 0o7777;
/// Bounds a hostile tree; a real directory with more entries is refused at scan.
pub const ENTRIES_MAX: usize = 1 << 20;

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

/// File bytes described by `entries`: file sizes, plus the totals that
/// directory entries carry; symlinks count nothing.
pub fn logical_bytes(entries: &[Entry]) -> u64 {
    entries
        .iter()
        .filter(|e| !matches!(e.kind, EntryKind::Symlink { .. }))
        .map(|e| e.size)
        .sum()
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
            if let EntryKind::Symlink { target } = &entry.kind
                && (target.is_empty()
                    || target.len() > SYMLINK_TARGET_BYTES_MAX
                    || target.contains(&0))
            {
                return Err(invalid_entry(&entry.name, "invalid symlink target"));
            }
        }
        let bytes = self.encode_unchecked();
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
        Ok(Tree { entries })
    }
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
        (name, 0u32..=0o7777, any::<i64>(), kind).prop_map(
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
            prop_assert_eq!(Tree::decode(&digest, &bytes).expect("decodes"), tree);
        }
    }
}
