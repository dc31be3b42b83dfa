//! Block rules and the at-rest encoding of objects.
//!
//! A file of up to [`SINGLE_BLOCK_BYTES_MAX`] is one block, addressed whole;
//! a larger file is split into fixed [`SPLIT_BLOCK_BYTES`] blocks. Every
//! object (block or tree) is stored as one frame byte and a payload: either
//! the plain bytes or a zstd frame, whichever is smaller by a useful margin.
//! The digest is always of the plain content and is checked on every read.

use crate::{Digest, Error, Result};

pub const SINGLE_BLOCK_BYTES_MAX: u64 = 8 * 1024 * 1024;
pub const SPLIT_BLOCK_BYTES: u64 = 4 * 1024 * 1024;

/// zstd level 1: on two cores the store is bound by hashing and I/O, and
/// level 1 keeps most of the ratio of level 3 on source trees at about
/// twice the speed.
const ZSTD_LEVEL: i32 = 1;

const FRAME_PLAIN: u8 = 0;
const FRAME_ZSTD: u8 = 1;

/// The byte ranges `(offset, length)` a file of `size` bytes is split into.
/// An empty file is one empty block.
pub fn block_ranges(size: u64) -> impl Iterator<Item = (u64, u64)> {
    let step = if size <= SINGLE_BLOCK_BYTES_MAX {
        size.max(1)
    } else {
        SPLIT_BLOCK_BYTES
    };
    let count = if size == 0 { 1 } else { size.div_ceil(step) };
    (0..count).map(move |i| {
        let offset = i * step;
        (offset, step.min(size - offset))
    })
}

/// Encode plain content for storage.
pub fn encode(plain: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(plain.len() + 1);
    // Tiny objects are not worth a zstd frame header.
    if plain.len() >= 64 {
        // Keep the compressed form only when it saves at least 1/16: give
        // the compressor exactly that much room, in place, so no second
        // buffer or copy is needed.
        let room = plain.len() - plain.len() / 16 - 1;
        out.push(FRAME_ZSTD);
        out.resize(1 + room, 0);
        if let Ok(written) = zstd::bulk::compress_to_buffer(plain, &mut out[1..], ZSTD_LEVEL) {
            out.truncate(1 + written);
            return out;
        }
        out.clear();
    }
    out.push(FRAME_PLAIN);
    out.extend_from_slice(plain);
    out
}

/// Decode a stored object and check that it hashes to `digest`.
pub fn decode(digest: &Digest, stored: &[u8]) -> Result<Vec<u8>> {
    let corrupt = || Error::Corrupt {
        digest: *digest,
        path: None,
    };
    let (&frame, payload) = stored.split_first().ok_or_else(corrupt)?;
    let plain = match frame {
        FRAME_PLAIN => payload.to_vec(),
        FRAME_ZSTD => {
            // Blocks are at most SINGLE_BLOCK_BYTES_MAX; the bound stops a
            // hostile frame from claiming gigabytes.
            zstd::bulk::decompress(payload, SINGLE_BLOCK_BYTES_MAX as usize)
                .map_err(|_| corrupt())?
        }
        _ => return Err(corrupt()),
    };
    if Digest::of(&plain) != *digest {
        return Err(corrupt());
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
}
