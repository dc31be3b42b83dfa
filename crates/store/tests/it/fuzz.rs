//! Property-based fuzzing of where hostile bytes enter the store: the tree
//! decoder (`Tree::decode`) and the at-rest block frame (`block::decode`).
//!
//! Stores and block services are not trusted: every object read is checked,
//! so these decoders see whatever a hostile store or client sends. The
//! generators start from valid encodings and break them (flipped, inserted,
//! deleted and overwritten bytes, truncation, counts and lengths at and past
//! their bounds), besides trees built entry by entry with invalid names,
//! orders, modes and block lists. Properties: no panic; a refusal is the
//! typed error naming the object; nothing is allocated in proportion to a
//! declared size (the largest single allocation is bounded by the input);
//! what decodes encodes back to the same bytes, and what `Tree::encode`
//! writes decodes to the same tree.
//!
//! Each target runs a bounded number of cases (a few seconds in a debug
//! build); `PROPTEST_CASES=100000 cargo test -p store --test it fuzz::` runs
//! them longer. A failing case is saved under `proptest-regressions/` and
//! replayed first on every later run; fixed crashes also get a named
//! `regression_*` test here.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use proptest::prelude::*;
use proptest::sample::Index;
use store::block::{self, SINGLE_BLOCK_BYTES_MAX, block_ranges};
use store::tree::{ENTRIES_MAX, Entry, EntryKind, NAME_BYTES_MAX, SYMLINK_TARGET_BYTES_MAX, Tree};
use store::{Digest, Error};

/// `cases` unless `PROPTEST_CASES` asks for another number.
fn config(cases: u32) -> ProptestConfig {
    let mut config = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = cases;
    }
    config
}

// ---------------------------------------------------------------------------
// The largest allocation a call makes.

/// The system allocator, noting the largest single allocation a thread
/// makes while [`largest_allocation`] watches it: a decoder that sizes a
/// buffer by a declared count shows here long before it exhausts memory.
struct Watching;

thread_local! {
    static WATCHING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: allocations during thread teardown find no cells.
    let _ = WATCHING.try_with(|watching| {
        if watching.get() {
            let _ = LARGEST.try_with(|largest| largest.set(largest.get().max(size)));
        }
    });
}

#[allow(unsafe_code)]
// SAFETY: every call goes to the system allocator unchanged; the only
// addition is `note`, which touches two const-initialised thread-local
// cells and neither allocates nor panics.
unsafe impl GlobalAlloc for Watching {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract for `alloc_zeroed` is passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: the caller's contract for `realloc` is passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc` is passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Watching = Watching;

/// What `f` returns, and the largest single allocation it made on this
/// thread.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|largest| largest.set(0));
    WATCHING.with(|watching| watching.set(true));
    let out = f();
    WATCHING.with(|watching| watching.set(false));
    (out, LARGEST.with(Cell::get))
}

// ---------------------------------------------------------------------------
// Byte mutations of a valid encoding.

/// Numbers at and around the bounds the formats declare.
const INTERESTING: &[u64] = &[
    0,
    1,
    31,
    32,
    33,
    255,
    256,
    4095,
    4096,
    65535,
    65536,
    (1 << 20) - 1,
    1 << 20,
    (1 << 20) + 1,
    SINGLE_BLOCK_BYTES_MAX - 1,
    SINGLE_BLOCK_BYTES_MAX,
    SINGLE_BLOCK_BYTES_MAX + 1,
    u32::MAX as u64,
    i64::MAX as u64,
    u64::MAX - 1,
    u64::MAX,
];

#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    Insert(Index, u8),
    Delete(Index),
    Truncate(Index),
    /// An interesting number, little-endian, over `width` bytes at a place.
    Overwrite(Index, usize, u64),
    /// A copy of a stretch appended again (repeated entries, frames).
    Duplicate(Index, Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip(at, bit)),
        (any::<Index>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert(at, byte)),
        any::<Index>().prop_map(Mutation::Delete),
        any::<Index>().prop_map(Mutation::Truncate),
        (
            any::<Index>(),
            prop::sample::select(vec![1usize, 2, 4, 8]),
            prop::sample::select(INTERESTING)
        )
            .prop_map(|(at, width, value)| Mutation::Overwrite(at, width, value)),
        (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::Duplicate(a, b)),
    ]
}

fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for mutation in mutations {
        let len = bytes.len();
        match mutation {
            Mutation::Flip(at, bit) if len > 0 => bytes[at.index(len)] ^= 1u8 << bit,
            Mutation::Insert(at, byte) => bytes.insert(at.index(len + 1), *byte),
            Mutation::Delete(at) if len > 0 => {
                bytes.remove(at.index(len));
            }
            Mutation::Truncate(at) => bytes.truncate(at.index(len + 1)),
            Mutation::Overwrite(at, width, value) if len >= *width => {
                let at = at.index(len - width + 1);
                bytes[at..at + width].copy_from_slice(&value.to_le_bytes()[..*width]);
            }
            Mutation::Duplicate(a, b) if len > 0 => {
                let (a, b) = (a.index(len), b.index(len));
                let stretch = bytes[a.min(b)..=a.max(b)].to_vec();
                bytes.extend_from_slice(&stretch);
            }
            _ => {}
        }
    }
    bytes
}

// ---------------------------------------------------------------------------
// Trees.

fn valid_name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::collection::vec(1u8..=255, 1..12),
        1 => Just(vec![b'n'; NAME_BYTES_MAX]),
        1 => Just(b"...".to_vec()),
    ]
    .prop_filter("a valid name", |name| store::tree::is_valid_name(name))
}

/// Any name at all, valid or not.
fn any_name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => valid_name(),
        1 => prop::sample::select(vec![
            Vec::new(),
            b".".to_vec(),
            b"..".to_vec(),
            b"a/b".to_vec(),
            b"/etc".to_vec(),
            b"a\0b".to_vec(),
            vec![b'n'; NAME_BYTES_MAX + 1],
        ]),
    ]
}

fn file_size() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 0u64..20_000_000,
        1 => prop::sample::select(INTERESTING),
    ]
}

/// Digests for a file of `size` bytes, as many as the block rule says,
/// or none when that would be absurd (a hostile size).
fn blocks_for(size: u64) -> Vec<Digest> {
    if size > 64 * SINGLE_BLOCK_BYTES_MAX {
        return Vec::new();
    }
    block_ranges(size)
        .map(|(offset, _)| Digest::of(&offset.to_le_bytes()))
        .collect()
}

/// An entry `Tree::encode` accepts (within a size that keeps totals far
/// from overflowing).
fn valid_entry() -> impl Strategy<Value = Entry> {
    let kind = prop_oneof![
        (0u64..40_000_000).prop_map(|size| (
            size,
            EntryKind::File {
                blocks: blocks_for(size)
            }
        )),
        (any::<[u8; 32]>(), 0u64..1 << 40)
            .prop_map(|(tree, size)| (size, EntryKind::Dir { tree: Digest(tree) })),
        prop_oneof![
            prop::collection::vec(1u8..=255, 1..64),
            Just(vec![b't'; SYMLINK_TARGET_BYTES_MAX]),
        ]
        .prop_map(|target| (target.len() as u64, EntryKind::Symlink { target })),
    ];
    (valid_name(), 0u32..=0o1777, any::<i64>(), kind).prop_map(
        |(name, mode, mtime_ns, (size, kind))| Entry {
            name,
            mode,
            size,
            mtime_ns,
            kind,
        },
    )
}

/// Any entry: invalid names, modes with any bits, sizes that do not match
/// their blocks, symlink targets empty, with NUL or past the bound.
fn hostile_entry() -> impl Strategy<Value = Entry> {
    let kind = prop_oneof![
        (file_size(), any::<bool>(), 0usize..3).prop_map(|(size, honest, extra)| {
            let mut blocks = blocks_for(size);
            // One block short, or `extra` too many.
            if !honest && extra == 0 {
                blocks.pop();
            } else if !honest {
                blocks.extend((0..extra).map(|i| Digest::of(&[i as u8])));
            }
            (size, EntryKind::File { blocks })
        }),
        (any::<[u8; 32]>(), prop::sample::select(INTERESTING))
            .prop_map(|(tree, size)| (size, EntryKind::Dir { tree: Digest(tree) })),
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..64),
            prop::sample::select(vec![
                SYMLINK_TARGET_BYTES_MAX,
                SYMLINK_TARGET_BYTES_MAX + 1,
                u16::MAX as usize
            ])
            .prop_map(|len| vec![b't'; len]),
        ]
        .prop_map(|target| (target.len() as u64, EntryKind::Symlink { target })),
    ];
    let mode = prop_oneof![4 => 0u32..=0o7777, 1 => any::<u32>()];
    (any_name(), mode, any::<i64>(), kind).prop_map(|(name, mode, mtime_ns, (size, kind))| Entry {
        name,
        mode,
        size,
        mtime_ns,
        kind,
    })
}

fn valid_tree() -> impl Strategy<Value = Tree> {
    prop::collection::vec(valid_entry(), 0..24).prop_map(|mut entries| {
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        entries.dedup_by(|a, b| a.name == b.name);
        Tree { entries }
    })
}

/// Bytes a tree decoder may be handed: valid encodings broken byte by byte,
/// hostile trees encoded as given, or a header that declares far more
/// entries than follow.
fn tree_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => (valid_tree(), prop::collection::vec(mutation(), 0..6))
            .prop_map(|(tree, mutations)| mutate(tree.encode_unchecked(), &mutations)),
        2 => (prop::collection::vec(hostile_entry(), 0..8), any::<bool>()).prop_map(
            |(entries, sorted)| {
                let mut tree = Tree { entries };
                if sorted {
                    tree.entries.sort_by(|a, b| a.name.cmp(&b.name));
                }
                tree.encode_unchecked()
            }
        ),
        1 => (
            prop::sample::select(vec![
                1u32,
                4096,
                ENTRIES_MAX as u32,
                ENTRIES_MAX as u32 + 1,
                u32::MAX
            ]),
            prop::collection::vec(any::<u8>(), 0..200),
        )
            .prop_map(|(count, rest)| {
                let mut bytes = b"RTREE\x01".to_vec();
                bytes.extend_from_slice(&count.to_le_bytes());
                bytes.extend_from_slice(&rest);
                bytes
            }),
    ]
}

/// Decoding `bytes` as the tree they hash to: no panic, a typed refusal or
/// a tree that is exactly what the bytes say, memory bounded by the input.
fn check_tree(bytes: &[u8]) -> Result<(), TestCaseError> {
    let digest = Digest::of(bytes);
    let (decoded, largest) = largest_allocation(|| Tree::decode(&digest, bytes));
    // Entries are at least 27 encoded bytes (a one-byte symlink) and take
    // about 100 in memory, in a vector that may double; a declared count
    // may reserve at most the first 4096 before they are read.
    let entry = std::mem::size_of::<Entry>();
    let bound = 8 * bytes.len() + 4096 * entry;
    prop_assert!(
        largest <= bound,
        "a {}-byte tree made a {largest}-byte allocation",
        bytes.len()
    );
    match decoded {
        Ok(tree) => {
            // The encoding is canonical: nothing decodes that encodes
            // otherwise, so a digest names one tree.
            prop_assert_eq!(&tree.encode_unchecked(), bytes);
            // What decodes can be written back by the checked encoder
            // (setuid and setgid aside: a separate rule may refuse them
            // on writing while old trees holding them stay readable).
            let mut writable = tree.clone();
            for entry in &mut writable.entries {
                entry.mode &= 0o1777;
            }
            if let Err(error) = writable.encode() {
                prop_assert!(false, "decoded but cannot be encoded: {}", error);
            }
        }
        Err(Error::MalformedTree { digest: named, .. }) => prop_assert_eq!(named, digest),
        Err(other) => prop_assert!(false, "untyped refusal: {other}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(1024))]

    #[test]
    fn tree_decode_survives_hostile_bytes(bytes in tree_bytes()) {
        check_tree(&bytes)?;
    }

    #[test]
    fn trees_round_trip(tree in valid_tree()) {
        let (digest, bytes) = tree.clone().encode().expect("a valid tree encodes");
        prop_assert_eq!(Tree::decode(&digest, &bytes).expect("decodes"), tree);
    }
}

/// A file entry claiming `u64::MAX` bytes: the decoder counted the blocks
/// such a size needs by walking them, 2^42 steps in a debug build (hours on
/// one core), before refusing the tree. Found by `tree_decode_survives_
/// hostile_bytes`, which hung on it; `block::block_count` is arithmetic
/// now.
#[test]
fn regression_huge_file_size_is_refused_at_once() {
    for size in [u64::MAX, i64::MAX as u64, u64::MAX - SINGLE_BLOCK_BYTES_MAX] {
        let bytes = Tree {
            entries: vec![Entry {
                name: b"f".to_vec(),
                mode: 0o644,
                size,
                mtime_ns: 0,
                kind: EntryKind::File { blocks: Vec::new() },
            }],
        }
        .encode_unchecked();
        let refused = Tree::decode(&Digest::of(&bytes), &bytes);
        assert!(
            matches!(&refused, Err(Error::MalformedTree { reason, .. }) if reason.contains("block count")),
            "{refused:?}"
        );
    }
}

/// A symlink target of 4,096 to 65,535 bytes fits the encoding's u16
/// length: the decoder took it, though `Tree::encode` refuses it and no
/// scan makes one, so a tree read from the store could not be written
/// back (and pull would hand the kernel a target it refuses). Found by
/// `tree_decode_survives_hostile_bytes`.
#[test]
fn regression_symlink_target_past_the_bound_is_refused() {
    for (len, accepted) in [
        (SYMLINK_TARGET_BYTES_MAX, true),
        (SYMLINK_TARGET_BYTES_MAX + 1, false),
        (u16::MAX as usize, false),
    ] {
        let bytes = Tree {
            entries: vec![Entry {
                name: b"l".to_vec(),
                mode: 0o777,
                size: len as u64,
                mtime_ns: 0,
                kind: EntryKind::Symlink {
                    target: vec![b't'; len],
                },
            }],
        }
        .encode_unchecked();
        let decoded = Tree::decode(&Digest::of(&bytes), &bytes);
        assert_eq!(decoded.is_ok(), accepted, "a target of {len} bytes");
    }
}

// ---------------------------------------------------------------------------
// Block frames.

/// Plain content: random, or compressible enough to be stored as zstd.
fn plain() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        (any::<u8>(), 64usize..200_000).prop_map(|(byte, len)| vec![byte; len]),
        (prop::collection::vec(any::<u8>(), 1..16), 1usize..5_000)
            .prop_map(|(word, times)| word.repeat(times)),
    ]
}

/// What a block decoder may be handed: a stored frame, broken or not, and
/// the digest it is asked for (the plain content's, or another).
fn stored_frame() -> impl Strategy<Value = (Vec<u8>, Digest)> {
    (
        plain(),
        prop::collection::vec(mutation(), 0..4),
        prop::option::of(0u8..=3),
        any::<bool>(),
    )
        .prop_map(|(plain, mutations, frame_byte, right_digest)| {
            let mut stored = mutate(block::encode(&plain), &mutations);
            if let (Some(byte), Some(first)) = (frame_byte, stored.first_mut()) {
                *first = byte;
            }
            let digest = if right_digest {
                Digest::of(&plain)
            } else {
                Digest::of(&stored)
            };
            (stored, digest)
        })
}

fn check_block(stored: &[u8], digest: &Digest) -> Result<(), TestCaseError> {
    let (decoded, largest) = largest_allocation(|| block::decode(digest, stored));
    let bound = stored.len().max(SINGLE_BLOCK_BYTES_MAX as usize);
    prop_assert!(
        largest <= bound,
        "a {}-byte frame made a {largest}-byte allocation",
        stored.len()
    );
    // A pull's path (`decode_in`, with the buffer it keeps) agrees.
    let mut buffer = Vec::new();
    let in_place = block::decode_in(digest, stored, &mut buffer).map(<[u8]>::to_vec);
    prop_assert_eq!(in_place.as_ref().ok(), decoded.as_ref().ok());
    prop_assert_eq!(in_place.is_err(), decoded.is_err());
    match decoded {
        Ok(plain) => prop_assert_eq!(Digest::of(&plain), *digest),
        Err(Error::Corrupt {
            digest: named,
            path: None,
            ..
        }) => prop_assert_eq!(named, *digest),
        Err(other) => prop_assert!(false, "untyped refusal: {other}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn block_decode_survives_hostile_frames((stored, digest) in stored_frame()) {
        check_block(&stored, &digest)?;
    }

    #[test]
    fn blocks_round_trip(plain in plain()) {
        let stored = block::encode(&plain);
        prop_assert_eq!(block::decode(&Digest::of(&plain), &stored).ok(), Some(plain));
    }
}

/// A zstd frame without a size in its header that expands past a block
/// (a decompression bomb: 64 MiB of zeros in a few kilobytes) is refused
/// within a block's worth of memory.
#[test]
fn zstd_bombs_are_refused_within_a_block() {
    let zeros = vec![0u8; 64 << 20];
    let bomb = zstd::stream::encode_all(zeros.as_slice(), 1).expect("compress");
    assert!(bomb.len() < 64 << 10, "{} bytes", bomb.len());
    let stored = [vec![1u8], bomb].concat();
    let digest = Digest::of(&zeros);
    drop(zeros);
    let (decoded, largest) = largest_allocation(|| block::decode(&digest, &stored));
    assert!(matches!(decoded, Err(Error::Corrupt { .. })), "{decoded:?}");
    assert!(largest <= SINGLE_BLOCK_BYTES_MAX as usize, "{largest}");
}
