//! Block rules and the at-rest encoding of objects.
//!
//! A file of up to [`SINGLE_BLOCK_BYTES_MAX`] is one block, addressed whole;
//! a larger file is split into fixed [`SPLIT_BLOCK_BYTES`] blocks. Every
//! object (block or tree) is stored as one frame byte and a payload: either
//! the plain bytes or a zstd frame, whichever is smaller by a useful margin.
//! The digest is always of the plain content and is checked on every read.

use crate::{Corruption, Digest, Error, Result};

pub const SINGLE_BLOCK_BYTES_MAX: u64 = 8 * 1024 * 1024;
pub const SPLIT_BLOCK_BYTES: u64 = 4 * 1024 * 1024;

/// zstd level 1: on two cores the store is bound by hashing and I/O, and
/// level 1 keeps most of the ratio of level 3 on source trees at about
/// twice the speed.
const ZSTD_LEVEL: i32 = 1;

const FRAME_PLAIN: u8 = 0;
const FRAME_ZSTD: u8 = 1;

/// How many blocks a file of `size` bytes is split into: the length of
/// [`block_ranges`], by arithmetic, so that checking a hostile size
/// (`u64::MAX` is 2^42 blocks) costs nothing.
pub fn block_count(size: u64) -> u64 {
    if size <= SINGLE_BLOCK_BYTES_MAX {
        1
    } else {
        size.div_ceil(SPLIT_BLOCK_BYTES)
    }
}

/// The byte ranges `(offset, length)` a file of `size` bytes is split into.
/// An empty file is one empty block.
pub fn block_ranges(size: u64) -> impl Iterator<Item = (u64, u64)> {
    let step = if size <= SINGLE_BLOCK_BYTES_MAX {
        size.max(1)
    } else {
        SPLIT_BLOCK_BYTES
    };
    (0..block_count(size)).map(move |i| {
        let offset = i * step;
        (offset, step.min(size - offset))
    })
}

/// Encode plain content for storage.
pub fn encode(plain: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(plain.len() + 1);
    encode_into(plain, &mut out);
    out
}

/// Appends the stored form of `plain` to `out` (what [`encode`] returns):
/// a pack is built by encoding straight into its buffer, without a
/// buffer per object to copy from. Needs at most `plain.len() + 1` bytes.
pub fn encode_into(plain: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    out.reserve(plain.len() + 1);
    // Tiny objects are not worth a zstd frame header.
    if plain.len() >= 64 {
        // Keep the compressed form only when it saves at least 1/16. It is
        // written in place after the frame byte, into the room reserved
        // above and not zeroed first: zeroing it touched (and so made
        // resident) 15/16 of every block's size in a pack that kept a
        // fraction of it, and cost a memset of each block.
        let room = plain.len() - plain.len() / 16 - 1;
        out.push(FRAME_ZSTD);
        match compress_after(plain, out) {
            Some(written) if written <= room => return,
            _ => out.truncate(start),
        }
    }
    out.push(FRAME_PLAIN);
    out.extend_from_slice(plain);
}

thread_local! {
    /// One zstd context of each kind per thread: making one per block cost
    /// more than compressing or decompressing a small block.
    static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Appends `plain` compressed to `out`, within its spare capacity (zstd
/// writes there directly: a cursor at the end appends); the bytes written,
/// or `None` when they do not fit.
fn compress_after(plain: &[u8], out: &mut Vec<u8>) -> Option<usize> {
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = zstd::bulk::Compressor::new(ZSTD_LEVEL).ok();
        }
        let end = out.len() as u64;
        let mut cursor = std::io::Cursor::new(out);
        cursor.set_position(end);
        slot.as_mut()?.compress_to_buffer(plain, &mut cursor).ok()
    })
}

/// A zstd frame's content, sized by what its header says (our encoder
/// always writes the size), never more than a block: a hostile frame
/// cannot claim gigabytes, and a small block does not cost an 8 MiB buffer.
/// Decoded into `plain` (cleared first), so a caller decoding block after
/// block reuses one buffer: a fresh 4 MiB allocation per block is a fresh
/// mapping whose every page faults and is zeroed before it is written
/// (the kernel's page zeroing fell from 9.1 % to 5.2 % of a local pull's
/// samples with the buffer kept; BENCHMARKS.md "Packs (issue 18)").
fn decompress_into(payload: &[u8], plain: &mut Vec<u8>) -> std::result::Result<(), Corruption> {
    let frame = |reason: String| Corruption::Frame(reason);
    let declared = match zstd::zstd_safe::get_frame_content_size(payload) {
        Ok(Some(size)) if size <= SINGLE_BLOCK_BYTES_MAX => Some(size),
        Ok(Some(size)) => {
            return Err(frame(format!(
                "the zstd frame declares {size} bytes, more than a block holds ({SINGLE_BLOCK_BYTES_MAX})"
            )));
        }
        Ok(None) => None,
        Err(_) => return Err(frame("not a zstd frame".to_owned())),
    };
    match zstd::zstd_safe::find_frame_compressed_size(payload) {
        Ok(size) if size == payload.len() => {}
        Ok(size) => {
            return Err(frame(format!(
                "{} bytes follow the zstd frame",
                payload.len() - size
            )));
        }
        Err(_) => return Err(frame("the zstd frame is cut short".to_owned())),
    }
    let capacity = declared.map_or(SINGLE_BLOCK_BYTES_MAX, |size| size) as usize;
    plain.clear();
    plain.reserve(capacity);
    DECOMPRESSOR
        .with(|cell| {
            let mut slot = cell.borrow_mut();
            if slot.is_none() {
                *slot = zstd::bulk::Decompressor::new().ok();
            }
            // Writes from the start of `plain`, within its capacity.
            slot.as_mut()
                .map(|d| d.decompress_to_buffer(payload, plain))
        })
        .ok_or_else(|| frame("no zstd decompressor".to_owned()))?
        .map_err(|e| frame(format!("the zstd frame does not decode: {e}")))?;
    if let Some(expected) = declared
        && plain.len() as u64 != expected
    {
        return Err(Corruption::LengthMismatch {
            expected,
            found: plain.len() as u64,
        });
    }
    // A buffer kept from a larger use could have let a sizeless frame
    // run past a block.
    if plain.len() as u64 > SINGLE_BLOCK_BYTES_MAX {
        return Err(frame(format!(
            "the zstd frame decodes to more than a block holds ({SINGLE_BLOCK_BYTES_MAX})"
        )));
    }
    Ok(())
}

/// Decode a stored object and check that it hashes to `digest`.
pub fn decode(digest: &Digest, stored: &[u8]) -> Result<Vec<u8>> {
    let mut plain = Vec::new();
    match decode_frame(digest, stored, &mut plain)? {
        Some(payload) => Ok(payload.to_vec()),
        None => Ok(plain),
    }
}

/// [`decode`] without an allocation per object: a plain frame's content
/// is `stored`'s own bytes, a compressed one's is decompressed into
/// `buffer` (whose capacity a caller keeps from object to object).
pub fn decode_in<'a>(
    digest: &Digest,
    stored: &'a [u8],
    buffer: &'a mut Vec<u8>,
) -> Result<&'a [u8]> {
    match decode_frame(digest, stored, buffer)? {
        Some(payload) => Ok(payload),
        None => Ok(buffer),
    }
}

/// The verified content of `stored`: `Some` of its own bytes for a plain
/// frame, `None` when it was decompressed into `buffer`.
fn decode_frame<'a>(
    digest: &Digest,
    stored: &'a [u8],
    buffer: &mut Vec<u8>,
) -> Result<Option<&'a [u8]>> {
    let corrupt = |reason: Corruption| Error::Corrupt {
        digest: *digest,
        path: None,
        reason,
    };
    let (&frame, payload) = stored
        .split_first()
        .ok_or_else(|| corrupt(Corruption::Frame("empty: no frame byte".to_owned())))?;
    let plain = match frame {
        FRAME_PLAIN => Some(payload),
        FRAME_ZSTD => {
            decompress_into(payload, buffer).map_err(corrupt)?;
            None
        }
        other => {
            return Err(corrupt(Corruption::Frame(format!(
                "unknown frame byte {other:#04x}"
            ))));
        }
    };
    if Digest::of(plain.unwrap_or(buffer)) != *digest {
        return Err(corrupt(Corruption::HashMismatch));
    }
    Ok(plain)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    fn check(size: u64, expected: &[(u64, u64)]) {
        let ranges: Vec<_> = block_ranges(size).collect();
        assert_eq!(ranges, expected, "size {size}");
        assert_eq!(block_count(size), expected.len() as u64, "size {size}");
    }

    #[test]
    fn block_rule_boundaries() {
        check(0, &[(0, 0)]);
        check(1, &[(0, 1)]);
        check(8 * MIB, &[(0, 8 * MIB)]);
        check(
            8 * MIB + 1,
            &[(0, 4 * MIB), (4 * MIB, 4 * MIB), (8 * MIB, 1)],
        );
        check(
            12 * MIB,
            &[(0, 4 * MIB), (4 * MIB, 4 * MIB), (8 * MIB, 4 * MIB)],
        );
        check(
            16 * MIB,
            &[
                (0, 4 * MIB),
                (4 * MIB, 4 * MIB),
                (8 * MIB, 4 * MIB),
                (12 * MIB, 4 * MIB),
            ],
        );
    }

    #[test]
    fn frames_round_trip_and_detect_corruption() {
        for plain in [
            Vec::new(),
            b"short".to_vec(),
            vec![7u8; 100_000],
            (0..100_000u32)
                .map(|i| (i.wrapping_mul(2654435761u32) >> 24) as u8)
                .collect(),
        ] {
            let digest = Digest::of(&plain);
            let stored = encode(&plain);
            assert_eq!(decode(&digest, &stored).ok(), Some(plain.clone()));
            let mut bad = stored.clone();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            if !plain.is_empty() {
                assert!(matches!(decode(&digest, &bad), Err(Error::Corrupt { .. })));
            }
            assert!(decode(&Digest::of(b"other"), &stored).is_err());
        }
        assert!(
            encode(&[7u8; 100_000]).len() < 1000,
            "compressible is compressed"
        );
    }

    /// A pack is built by appending: what is already in the buffer stays,
    /// and the object is encoded after it exactly as alone; a block that
    /// compresses by less than 1/16 is stored plain.
    #[test]
    fn encoding_appends_and_keeps_only_a_useful_compression() {
        let noise = |n: usize| -> Vec<u8> {
            let mut bytes = vec![0u8; n];
            blake3::Hasher::new().finalize_xof().fill(&mut bytes);
            bytes
        };
        let compressible = vec![3u8; 200_000];
        // 3 % zeros, the rest noise: zstd saves about 3 %, under 1/16.
        let marginal = [vec![0u8; 3_000], noise(97_000)].concat();
        for plain in [compressible, marginal.clone(), noise(100_000)] {
            let mut out = b"prefix".to_vec();
            encode_into(&plain, &mut out);
            assert_eq!(&out[..6], b"prefix");
            assert_eq!(out[6..], encode(&plain)[..]);
            assert_eq!(decode(&Digest::of(&plain), &out[6..]).ok(), Some(plain));
        }
        let stored = encode(&marginal);
        assert_eq!(
            (stored[0], stored.len()),
            (FRAME_PLAIN, marginal.len() + 1),
            "a compression that saves under 1/16 is not kept"
        );
    }

    /// Issue 14: a cut or padded upload said "hash mismatch"; each
    /// corruption now names the first check it failed.
    #[test]
    fn corruption_names_what_is_wrong() {
        let reason = |digest: &Digest, stored: &[u8]| match decode(digest, stored) {
            Err(Error::Corrupt { reason, .. }) => reason,
            other => panic!("expected Corrupt, got {other:?}"),
        };
        let plain = vec![5u8; 100_000];
        let digest = Digest::of(&plain);
        let stored = encode(&plain);
        assert_eq!(stored[0], FRAME_ZSTD, "compressible, so zstd");
        let cut = &stored[..stored.len() - 3];
        assert_eq!(
            reason(&digest, cut),
            Corruption::Frame("the zstd frame is cut short".to_owned())
        );
        let padded = [stored.as_slice(), b"xyz"].concat();
        assert_eq!(
            reason(&digest, &padded),
            Corruption::Frame("3 bytes follow the zstd frame".to_owned())
        );
        assert!(matches!(reason(&digest, &[]), Corruption::Frame(_)));
        assert_eq!(
            reason(&digest, &[9, 1, 2]),
            Corruption::Frame("unknown frame byte 0x09".to_owned())
        );
        assert_eq!(
            reason(&Digest::of(b"other"), &stored),
            Corruption::HashMismatch
        );
        let message = decode(&digest, cut).expect_err("cut").to_string();
        assert!(
            message.contains("cut short") && !message.contains("hash mismatch"),
            "{message}"
        );
    }

    #[test]
    fn zstd_frames_are_sized_by_their_header_and_bounded_by_a_block() {
        let zstd_frame = |payload: Vec<u8>| [vec![FRAME_ZSTD], payload].concat();
        // A frame that claims more than a block is refused unread.
        let over = vec![0u8; SINGLE_BLOCK_BYTES_MAX as usize + 1];
        let claimed = zstd::bulk::compress(&over, 1).expect("compress");
        assert!(matches!(
            decode(&Digest::of(&over), &zstd_frame(claimed)),
            Err(Error::Corrupt { .. })
        ));
        // A frame without a size in its header (a streaming encoder's)
        // still decodes, within the block bound.
        let plain = vec![3u8; 200_000];
        let sizeless = zstd::stream::encode_all(plain.as_slice(), 1).expect("encode");
        assert_eq!(
            zstd::zstd_safe::get_frame_content_size(&sizeless).ok(),
            Some(None),
            "no size in the header"
        );
        assert_eq!(
            decode(&Digest::of(&plain), &zstd_frame(sizeless)).ok(),
            Some(plain)
        );
        // Many blocks in a row on one thread reuse one context and decode.
        for i in 0..100u32 {
            let plain = format!("block number {i} {}", "x".repeat(100)).into_bytes();
            assert_eq!(
                decode(&Digest::of(&plain), &encode(&plain)).ok(),
                Some(plain)
            );
        }
    }

    /// A pull decodes block after block: a plain block is its stored
    /// bytes in place, a compressed one lands in the caller's buffer, which
    /// keeps its allocation from block to block; a sizeless frame cannot
    /// use a larger buffer to run past a block.
    #[test]
    fn decode_in_reads_plain_blocks_in_place_and_reuses_the_buffer() {
        let noise = {
            let mut bytes = vec![0u8; 300_000];
            blake3::Hasher::new().finalize_xof().fill(&mut bytes);
            bytes
        };
        let stored = encode(&noise);
        assert_eq!(stored[0], FRAME_PLAIN, "noise is stored plain");
        let mut buffer = Vec::new();
        let data = decode_in(&Digest::of(&noise), &stored, &mut buffer).expect("plain");
        assert_eq!(data, noise.as_slice());
        assert_eq!(data.as_ptr(), stored[1..].as_ptr(), "read in place");
        assert_eq!(buffer.capacity(), 0, "no buffer for a plain block");

        let mut buffer = Vec::with_capacity(SINGLE_BLOCK_BYTES_MAX as usize);
        let kept = buffer.as_ptr();
        for i in 0..20u8 {
            let plain = vec![i; 100_000 + usize::from(i) * 1000];
            let stored = encode(&plain);
            assert_eq!(stored[0], FRAME_ZSTD);
            let data = decode_in(&Digest::of(&plain), &stored, &mut buffer).expect("zstd");
            assert_eq!(data, plain.as_slice());
            assert_eq!(buffer.as_ptr(), kept, "the same allocation each time");
        }
        assert!(matches!(
            decode_in(&Digest::of(b"other"), &encode(&[1u8; 100_000]), &mut buffer),
            Err(Error::Corrupt {
                reason: Corruption::HashMismatch,
                ..
            })
        ));

        let over = vec![7u8; SINGLE_BLOCK_BYTES_MAX as usize + 10];
        let sizeless = zstd::stream::encode_all(over.as_slice(), 1).expect("encode");
        let mut large = Vec::with_capacity(2 * SINGLE_BLOCK_BYTES_MAX as usize);
        assert!(matches!(
            decode_in(
                &Digest::of(&over),
                &[vec![FRAME_ZSTD], sizeless].concat(),
                &mut large
            ),
            Err(Error::Corrupt {
                reason: Corruption::Frame(_),
                ..
            })
        ));
    }
}
