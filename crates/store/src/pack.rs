//! Packs: many objects in one store file, found through the pack's own
//! index file.
//!
//! Why: one file (or one S3 request) per object made a first push of a
//! 30k-file tree spend most of its time in `openat`, and an S3 wake one
//! GET per object. A pack holds the stored frames ([`crate::block::encode`])
//! of many objects back to back; its index, a separate immutable file
//! written after the pack, says where each one is. An object's name and
//! its check on read do not change: the digest of its plain content,
//! verified by [`crate::block::decode`] on every read.
//!
//! Keys (built only by [`crate::Store`]): `orgs/{org}/packs/{id}.pack` and
//! `orgs/{org}/packs/{id}.idx`, where `{id}` is 32 random hex digits
//! ([`PackId::random`]): concurrent writers (several servers, several
//! pushes, threads of one push) never write the same pack.
//!
//! Pack encoding, version 1:
//!
//! ```text
//! magic "RPACK" · version u8 = 1 · 2 zero bytes
//! the objects' stored frames, back to back, nothing between them
//! ```
//!
//! Index encoding, version 1 (integers little-endian):
//!
//! ```text
//! magic "RPIDX" · version u8 = 1
//! org name length u8 · org name bytes      (the org whose prefix holds it)
//! pack id: 16 bytes                          (the pack it describes)
//! pack length u64                            (the pack file's whole size)
//! born u64: 0, or the Unix time in ns its objects count their age from
//!           (a pack gc rewrote: the oldest pack it copied from)
//! entry count u32
//! per entry, in pack order: kind u8 (1 block, 2 tree) · digest [32]
//!                           · offset u64 · length u32
//! BLAKE3 of every byte above: [32]
//! ```
//!
//! Decoding refuses an index that lies ([`decode_index`]): a bad checksum,
//! another org or pack than where it was found (so an index copied into
//! another org's prefix cannot hand out that org's objects), entries that
//! do not tile the pack exactly (a gap, an overlap, an offset past the
//! end), an empty or oversized entry, or an object listed twice. The first
//! fault names the entry's object.
//!
//! Bounds: a pack holds at most [`PACK_BYTES_MAX`] of objects (the last one
//! may cross it) and [`PACK_OBJECTS_MAX`] objects, so its index is at
//! most about 3 MiB and an offset fits comfortably in a u64 (a length,
//! one object's frame, in a u32).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::block::SINGLE_BLOCK_BYTES_MAX;
use crate::store::{ObjectId, ObjectKind};
use crate::{Digest, OrgId};

const PACK_MAGIC: &[u8; 5] = b"RPACK";
const INDEX_MAGIC: &[u8; 5] = b"RPIDX";
const VERSION: u8 = 1;
/// Bytes before the first object in a pack.
pub const PACK_HEADER_BYTES: u64 = 8;
const KIND_BLOCK: u8 = 1;
const KIND_TREE: u8 = 2;
const ENTRY_BYTES: usize = 1 + 32 + 8 + 4;

/// Objects' bytes one pack holds at most (the object that crosses it is
/// the last). 16 MiB: a first push to S3 then costs about two requests
/// (pack and index) per 16 MiB, a repack rewrites at most that much to
/// drop a dead object, and a writer holds one pack in memory per thread.
pub const PACK_BYTES_MAX: u64 = 16 * 1024 * 1024;
/// What push hands a store that writes packs per batch (so per pack):
/// less than [`PACK_BYTES_MAX`] because each uploading thread holds its
/// pack and a block-sized read buffer, and push's peak memory at 100k
/// files must stay under 128 MiB.
pub const UPLOAD_PACK_BYTES: u64 = 8 * 1024 * 1024;
/// Objects one pack holds at most: bounds an index (~720 KiB) and what a
/// reader must fetch before it can read any object of the pack.
pub const PACK_OBJECTS_MAX: usize = 16 * 1024;
/// An object frame is at most a block plus its frame byte.
const ENTRY_LENGTH_MAX: u64 = SINGLE_BLOCK_BYTES_MAX + 1;

/// A pack's name: 16 random bytes, shown as 32 hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PackId(pub [u8; 16]);

impl PackId {
    /// A fresh id no other writer will pick: 16 bytes from the system's
    /// random source once per process, then BLAKE3 of them and a counter.
    pub fn random() -> PackId {
        static SEED: OnceLock<[u8; 32]> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let seed = SEED.get_or_init(|| {
            let mut seed = [0u8; 32];
            if getrandom::fill(&mut seed).is_err() {
                // No random source: time and pid still differ between
                // processes, and the counter within one.
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos());
                let mut hasher = blake3::Hasher::new();
                hasher.update(&nanos.to_le_bytes());
                hasher.update(&std::process::id().to_le_bytes());
                seed = *hasher.finalize().as_bytes();
            }
            seed
        });
        let mut hasher = blake3::Hasher::new_keyed(seed);
        hasher.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        let mut id = [0u8; 16];
        id.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
        PackId(id)
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl std::fmt::Display for PackId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl std::str::FromStr for PackId {
    type Err = ();
    fn from_str(s: &str) -> Result<PackId, ()> {
        if s.len() != 32 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(());
        }
        let mut id = [0u8; 16];
        for (i, byte) in id.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| ())?;
        }
        Ok(PackId(id))
    }
}

/// Where one object is in its pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub object: ObjectId,
    pub offset: u64,
    pub length: u32,
}

/// A decoded, checked index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackIndex {
    pub pack: PackId,
    pub pack_bytes: u64,
    /// When its objects were first stored, for a pack that gc rewrote
    /// (its objects keep their age: a rewrite is not an upload, and a
    /// rewritten dead object must not look young); `None`: the pack's own
    /// time.
    pub born: Option<std::time::SystemTime>,
    /// In pack order.
    pub entries: Vec<Entry>,
}

/// Builds a pack in memory from stored frames, with its index entries.
pub struct PackBuilder {
    bytes: Vec<u8>,
    entries: Vec<Entry>,
    /// An object goes in once (an index listing one twice is refused).
    seen: std::collections::HashSet<ObjectId>,
}

impl Default for PackBuilder {
    fn default() -> Self {
        PackBuilder::new()
    }
}

impl PackBuilder {
    pub fn new() -> PackBuilder {
        PackBuilder::with_capacity(0)
    }

    /// A builder whose buffer holds `stored_bytes` of objects without
    /// growing: a pack built from a batch of known size is then one
    /// allocation of its size, not a doubling buffer up to twice that.
    pub fn with_capacity(stored_bytes: usize) -> PackBuilder {
        let mut bytes = Vec::with_capacity(PACK_HEADER_BYTES as usize + stored_bytes);
        bytes.extend_from_slice(PACK_MAGIC);
        bytes.push(VERSION);
        bytes.extend_from_slice(&[0, 0]);
        PackBuilder {
            bytes,
            entries: Vec::new(),
            seen: std::collections::HashSet::new(),
        }
    }

    /// Whether `stored_len` more bytes go in this pack, or it is full.
    pub fn has_room(&self, stored_len: usize) -> bool {
        self.entries.is_empty()
            || (self.bytes.len() as u64 - PACK_HEADER_BYTES + stored_len as u64 <= PACK_BYTES_MAX
                && self.entries.len() < PACK_OBJECTS_MAX)
    }

    /// Appends an object; one already in this pack is skipped.
    pub fn push(&mut self, object: ObjectId, stored: &[u8]) {
        if !self.seen.insert(object) {
            return;
        }
        self.entries.push(Entry {
            object,
            offset: self.bytes.len() as u64,
            length: stored.len() as u32,
        });
        self.bytes.extend_from_slice(stored);
    }

    /// Encodes `plain` ([`crate::block::encode_into`]) straight into the
    /// pack, so no stored copy of the object exists beside the pack; one
    /// already in this pack is skipped. Returns the stored length added.
    pub fn push_plain(&mut self, object: ObjectId, plain: &[u8]) -> u64 {
        if !self.seen.insert(object) {
            return 0;
        }
        let offset = self.bytes.len();
        crate::block::encode_into(plain, &mut self.bytes);
        let length = self.bytes.len() - offset;
        self.entries.push(Entry {
            object,
            offset: offset as u64,
            length: length as u32,
        });
        length as u64
    }

    /// The objects in the pack, in order, with their stored bytes.
    pub fn objects(&self) -> impl Iterator<Item = (ObjectId, &[u8])> {
        self.entries.iter().map(|entry| {
            let start = entry.offset as usize;
            (
                entry.object,
                &self.bytes[start..start + entry.length as usize],
            )
        })
    }

    /// Stored bytes of the objects in the pack.
    pub fn stored_bytes(&self) -> u64 {
        self.bytes.len() as u64 - PACK_HEADER_BYTES
    }

    /// Whether the pack is one [`PackBuilder::has_room`] would have built:
    /// at most [`PACK_OBJECTS_MAX`] objects and [`PACK_BYTES_MAX`] bytes,
    /// unless it is a single object.
    pub fn within_bounds(&self) -> bool {
        self.entries.len() <= PACK_OBJECTS_MAX
            && (self.entries.len() <= 1 || self.stored_bytes() <= PACK_BYTES_MAX)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The pack's bytes and its index (for `org`, as `pack`).
    pub fn finish(
        self,
        org: &OrgId,
        pack: PackId,
        born: Option<std::time::SystemTime>,
    ) -> (Vec<u8>, Vec<u8>, PackIndex) {
        let index = PackIndex {
            pack,
            born,
            pack_bytes: self.bytes.len() as u64,
            entries: self.entries,
        };
        let encoded = encode_index(org, &index);
        (self.bytes, encoded, index)
    }
}

/// Encodes an index as it is, unchecked (tests build lying ones with it).
pub fn encode_index(org: &OrgId, index: &PackIndex) -> Vec<u8> {
    let org = org.as_str().as_bytes();
    let mut out = Vec::with_capacity(64 + org.len() + index.entries.len() * ENTRY_BYTES);
    out.extend_from_slice(INDEX_MAGIC);
    out.push(VERSION);
    out.push(org.len() as u8);
    out.extend_from_slice(org);
    out.extend_from_slice(&index.pack.0);
    out.extend_from_slice(&index.pack_bytes.to_le_bytes());
    let born = index.born.map_or(0, |born| {
        born.duration_since(std::time::UNIX_EPOCH).map_or(1, |d| {
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
        })
    });
    out.extend_from_slice(&born.to_le_bytes());
    out.extend_from_slice(&(index.entries.len() as u32).to_le_bytes());
    for entry in &index.entries {
        out.push(match entry.object.kind {
            ObjectKind::Block => KIND_BLOCK,
            ObjectKind::Tree => KIND_TREE,
        });
        out.extend_from_slice(&entry.object.digest.0);
        out.extend_from_slice(&entry.offset.to_le_bytes());
        out.extend_from_slice(&entry.length.to_le_bytes());
    }
    let checksum = blake3::hash(&out);
    out.extend_from_slice(checksum.as_bytes());
    out
}

/// Reads an index found at `org`'s key for `pack`, refusing any lie (see
/// the module documentation). The error is one line, naming the first
/// fault (and the object of a faulty entry).
pub fn decode_index(org: &OrgId, pack: &PackId, bytes: &[u8]) -> Result<PackIndex, String> {
    let body_len = bytes
        .len()
        .checked_sub(32)
        .ok_or("shorter than a checksum")?;
    let (body, checksum) = bytes.split_at(body_len);
    if blake3::hash(body).as_bytes() != checksum {
        return Err("checksum mismatch (torn or altered index)".to_owned());
    }
    let mut reader = Reader { bytes: body, at: 0 };
    if reader.take(5)? != INDEX_MAGIC {
        return Err("not a pack index (bad magic)".to_owned());
    }
    let version = reader.take(1)?[0];
    if version != VERSION {
        return Err(format!("unknown index version {version}"));
    }
    let org_len = reader.take(1)?[0] as usize;
    let named_org = reader.take(org_len)?;
    if named_org != org.as_str().as_bytes() {
        return Err(format!(
            "it describes a pack of org {:?}, not of {org}",
            String::from_utf8_lossy(named_org)
        ));
    }
    let named_pack = PackId(reader.take(16)?.try_into().map_err(|_| "short pack id")?);
    if named_pack != *pack {
        return Err(format!("it describes pack {named_pack}, not {pack}"));
    }
    let pack_bytes = reader.u64()?;
    let born = match reader.u64()? {
        0 => None,
        nanos => Some(std::time::UNIX_EPOCH + std::time::Duration::from_nanos(nanos)),
    };
    let count = reader.u32()? as usize;
    if count > PACK_OBJECTS_MAX {
        return Err(format!(
            "{count} entries, more than a pack holds ({PACK_OBJECTS_MAX})"
        ));
    }
    if reader.bytes.len() - reader.at != count * ENTRY_BYTES {
        return Err(format!(
            "{} bytes of entries for {count} entries",
            reader.bytes.len() - reader.at
        ));
    }
    let mut entries = Vec::with_capacity(count);
    let mut seen = std::collections::HashSet::with_capacity(count);
    let mut expected_offset = PACK_HEADER_BYTES;
    for _ in 0..count {
        let kind = reader.take(1)?[0];
        let digest = Digest(reader.take(32)?.try_into().map_err(|_| "short digest")?);
        let object = match kind {
            KIND_BLOCK => ObjectId::block(digest),
            KIND_TREE => ObjectId::tree(digest),
            other => return Err(format!("entry for {digest}: unknown kind {other}")),
        };
        let offset = reader.u64()?;
        let length = reader.u32()?;
        let fault = |what: String| format!("entry for object {digest}: {what}");
        if length == 0 || u64::from(length) > ENTRY_LENGTH_MAX {
            return Err(fault(format!("length {length} out of bounds")));
        }
        let end = offset
            .checked_add(u64::from(length))
            .ok_or_else(|| fault("offset overflows".to_owned()))?;
        if end > pack_bytes {
            return Err(fault(format!(
                "bytes {offset}..{end} past the pack's end ({pack_bytes})"
            )));
        }
        if offset < expected_offset {
            return Err(fault(format!(
                "offset {offset} overlaps the object before (which ends at {expected_offset})"
            )));
        }
        if offset > expected_offset {
            return Err(fault(format!(
                "offset {offset} leaves a gap after {expected_offset}"
            )));
        }
        if !seen.insert(object) {
            return Err(fault("listed twice".to_owned()));
        }
        expected_offset = end;
        entries.push(Entry {
            object,
            offset,
            length,
        });
    }
    if expected_offset != pack_bytes {
        return Err(format!(
            "entries end at {expected_offset}, the pack at {pack_bytes}"
        ));
    }
    Ok(PackIndex {
        pack: *pack,
        pack_bytes,
        born,
        entries,
    })
}

/// Checks a pack's header (its first bytes).
pub fn check_pack_header(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < PACK_HEADER_BYTES as usize || &bytes[..5] != PACK_MAGIC || bytes[5] != VERSION
    {
        return Err("not a version 1 pack (bad header)".to_owned());
    }
    Ok(())
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or("cut short")?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().map_err(|_| "cut short")?,
        ))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().map_err(|_| "cut short")?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn org() -> OrgId {
        "acme".parse().expect("org")
    }

    fn built(objects: &[&[u8]]) -> (Vec<u8>, Vec<u8>, PackIndex) {
        let mut builder = PackBuilder::new();
        for plain in objects {
            builder.push(
                ObjectId::block(Digest::of(plain)),
                &crate::block::encode(plain),
            );
        }
        builder.finish(&org(), PackId([7; 16]), None)
    }

    #[test]
    fn packs_and_indexes_round_trip() {
        let (pack, index_bytes, index) = built(&[b"one", b"two", &[9u8; 5000]]);
        check_pack_header(&pack).expect("header");
        let decoded = decode_index(&org(), &PackId([7; 16]), &index_bytes).expect("decodes");
        assert_eq!(decoded, index);
        for (entry, plain) in index
            .entries
            .iter()
            .zip([&b"one"[..], b"two", &[9u8; 5000]])
        {
            let range = entry.offset as usize..entry.offset as usize + entry.length as usize;
            let read = crate::block::decode(&entry.object.digest, &pack[range]).expect("verifies");
            assert_eq!(read, plain);
        }
    }

    #[test]
    fn a_rewritten_pack_keeps_its_objects_age() {
        let (_, _, mut index) = built(&[b"one"]);
        let born = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        index.born = Some(born);
        let decoded =
            decode_index(&org(), &index.pack, &encode_index(&org(), &index)).expect("decodes");
        assert_eq!(decoded.born, Some(born));
    }

    #[test]
    fn lying_indexes_are_refused_naming_the_fault() {
        let (_, _, index) = built(&[b"one", b"two"]);
        let refused = |index: &PackIndex, org_name: &str, pack: PackId| {
            let found_at: OrgId = org_name.parse().expect("org");
            decode_index(&found_at, &pack, &encode_index(&org(), index)).expect_err("refused")
        };
        let id = PackId([7; 16]);
        let mut past = index.clone();
        past.entries[1].offset += 100;
        assert!(refused(&past, "acme", id).contains("past the pack's end"));
        let mut overlap = index.clone();
        overlap.entries[1].offset -= 1;
        assert!(refused(&overlap, "acme", id).contains("overlaps"));
        let mut twice = index.clone();
        twice.entries[1].object = twice.entries[0].object;
        twice.entries[1].offset = twice.entries[0].offset + u64::from(twice.entries[0].length);
        assert!(!refused(&twice, "acme", id).is_empty());
        assert!(refused(&index, "other", id).contains("org \"acme\""));
        assert!(refused(&index, "acme", PackId([8; 16])).contains("describes pack"));
        let mut bytes = encode_index(&org(), &index);
        bytes[10] ^= 1;
        assert!(
            decode_index(&org(), &id, &bytes)
                .expect_err("refused")
                .contains("checksum")
        );
        assert!(decode_index(&org(), &id, &bytes[..bytes.len() - 5]).is_err());
    }

    #[test]
    fn builders_respect_their_bounds_and_ids_differ() {
        let mut builder = PackBuilder::new();
        assert!(
            builder.has_room(PACK_BYTES_MAX as usize * 2),
            "an empty pack takes anything"
        );
        builder.push(ObjectId::block(Digest::of(b"x")), &[0; 10]);
        assert!(builder.has_room(PACK_BYTES_MAX as usize - 10));
        assert!(!builder.has_room(PACK_BYTES_MAX as usize - 9));
        let ids: std::collections::HashSet<PackId> = (0..1000).map(|_| PackId::random()).collect();
        assert_eq!(ids.len(), 1000);
        let id = PackId::random();
        assert_eq!(id.to_hex().parse::<PackId>(), Ok(id));
    }
}
