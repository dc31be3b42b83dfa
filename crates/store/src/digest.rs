//! BLAKE3 digests: the only way objects are named.

use std::fmt;
use std::str::FromStr;

/// The BLAKE3 hash of an object's plain (uncompressed) content.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    pub const LEN: usize = 32;

    pub fn of(content: &[u8]) -> Digest {
        Digest(*blake3::hash(content).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        let mut out = String::with_capacity(64);
        for byte in self.0 {
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        out
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl From<blake3::Hash> for Digest {
    fn from(hash: blake3::Hash) -> Digest {
        Digest(*hash.as_bytes())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", &self.to_hex()[..12])
    }
}

#[derive(Debug, thiserror::Error)]
#[error("not a digest (64 lowercase hex characters): {0:?}")]
pub struct ParseDigestError(String);

impl FromStr for Digest {
    type Err = ParseDigestError;

    fn from_str(text: &str) -> Result<Digest, ParseDigestError> {
        let err = || ParseDigestError(text.chars().take(80).collect());
        let bytes = text.as_bytes();
        if bytes.len() != 64 {
            return Err(err());
        }
        let nibble = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let high = nibble(pair[0]).ok_or_else(err)?;
            let low = nibble(pair[1]).ok_or_else(err)?;
            out[i] = (high << 4) | low;
        }
        Ok(Digest(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let digest = Digest::of(b"hello");
        assert_eq!(digest.to_hex(), blake3::hash(b"hello").to_hex().as_str());
        assert_eq!(digest.to_hex().parse::<Digest>().ok(), Some(digest));
        assert!("ABCD".parse::<Digest>().is_err());
        assert!("g".repeat(64).parse::<Digest>().is_err());
    }
}
