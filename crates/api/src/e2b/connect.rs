//! The Connect protocol's framing, as envd speaks it: a unary call is a
//! plain JSON body (errors: an HTTP status and `{"code","message"}`); a
//! stream is a sequence of envelopes (one flags byte, a 4-byte big-endian
//! length, the message), the last one flagged end-of-stream with
//! `{"error"?}`.

use serde::{Deserialize, Serialize};

/// The content type of a unary JSON call.
pub const UNARY_JSON: &str = "application/json";
/// The content type of a streaming JSON call.
pub const STREAM_JSON: &str = "application/connect+json";
/// An envelope whose message is compressed (never sent by the SDKs:
/// compression is off; refused).
pub const FLAG_COMPRESSED: u8 = 0b01;
/// The stream's last envelope: `{"error"?: …, "metadata"?: …}`.
pub const FLAG_END_STREAM: u8 = 0b10;
/// The largest message roost takes in one envelope.
pub const MESSAGE_BYTES_MAX: usize = 4 * 1024 * 1024;

/// Connect's error codes (their JSON spellings) with the HTTP status a
/// unary error answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal | Code::DataLoss => 500,
            Code::InvalidArgument | Code::OutOfRange => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists | Code::Aborted => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::FailedPrecondition => 412,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        }
    }
}

/// A Connect error: a unary call's body, or the `error` of a stream's end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Error {
    pub code: Code,
    pub message: String,
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }
}

/// The end-of-stream message.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EndStream {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Error>,
}

/// One envelope: `flags`, then the message's length and bytes.
pub fn envelope(flags: u8, message: &[u8]) -> Vec<u8> {
    let mut framed = Vec::with_capacity(5 + message.len());
    framed.push(flags);
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(message);
    framed
}

/// A stream's message as an envelope (JSON).
pub fn message_envelope(message: &impl Serialize) -> Vec<u8> {
    envelope(0, &serde_json::to_vec(message).unwrap_or_default())
}

/// The end of a stream, with its error if it failed.
pub fn end_envelope(error: Option<Error>) -> Vec<u8> {
    let end = EndStream { error };
    envelope(
        FLAG_END_STREAM,
        &serde_json::to_vec(&end).unwrap_or_default(),
    )
}

/// Why a stream of envelopes could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("an envelope of {0} bytes is over the {MESSAGE_BYTES_MAX}-byte bound")]
    TooLarge(usize),
    #[error("a compressed envelope (compression is not negotiated)")]
    Compressed,
    #[error("the stream ended inside an envelope")]
    Truncated,
}

/// Splits bytes as they arrive into envelopes.
#[derive(Debug, Default)]
pub struct Decoder {
    buffer: Vec<u8>,
    /// Where the next envelope starts in `buffer`: what is before it was
    /// read, and goes at the next `push` (not at each envelope, which
    /// would move the rest of the buffer once per envelope: quadratic in a
    /// chunk of many small ones).
    start: usize,
    /// Bytes moved to compact the buffer, for the test that keeps this
    /// linear.
    #[cfg(test)]
    moved: usize,
}

impl Decoder {
    pub fn push(&mut self, bytes: &[u8]) {
        #[cfg(test)]
        {
            self.moved += self.buffer.len() - self.start;
        }
        self.buffer.drain(..self.start);
        self.start = 0;
        self.buffer.extend_from_slice(bytes);
    }

    /// The next whole envelope (flags, message), if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<(u8, Vec<u8>)>, FrameError> {
        let unread = &self.buffer[self.start..];
        if unread.len() < 5 {
            return Ok(None);
        }
        let flags = unread[0];
        let length = u32::from_be_bytes([unread[1], unread[2], unread[3], unread[4]]) as usize;
        if length > MESSAGE_BYTES_MAX {
            return Err(FrameError::TooLarge(length));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(FrameError::Compressed);
        }
        if unread.len() < 5 + length {
            return Ok(None);
        }
        let message = unread[5..5 + length].to_vec();
        self.start += 5 + length;
        Ok(Some((flags, message)))
    }

    /// At the end of the body: nothing may be left half-read.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.start == self.buffer.len() {
            Ok(())
        } else {
            Err(FrameError::Truncated)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_split_wherever_the_bytes_are_cut() {
        let mut bytes = envelope(0, br#"{"a":1}"#);
        bytes.extend(end_envelope(Some(Error::new(Code::NotFound, "gone"))));
        for cut in 0..bytes.len() {
            let mut decoder = Decoder::default();
            let mut frames = Vec::new();
            for part in [&bytes[..cut], &bytes[cut..]] {
                decoder.push(part);
                while let Some(frame) = decoder.next_frame().expect("in a test") {
                    frames.push(frame);
                }
            }
            decoder.finish().expect("in a test");
            assert_eq!(frames.len(), 2, "cut at {cut}");
            assert_eq!(frames[0], (0, br#"{"a":1}"#.to_vec()));
            assert_eq!(frames[1].0, FLAG_END_STREAM);
            let end: EndStream = serde_json::from_slice(&frames[1].1).expect("in a test");
            assert_eq!(end.error.expect("in a test").code, Code::NotFound);
        }
    }

    /// Audit finding: each envelope read moved the rest of the buffer, so
    /// a chunk of many small envelopes cost its length squared, on a
    /// worker every org shares. The unread rest moves once per chunk.
    #[test]
    fn a_chunk_of_many_envelopes_is_read_moving_each_byte_at_most_once() {
        let one = envelope(0, b"{}");
        let chunk: Vec<u8> = one.repeat(10_000);
        let mut decoder = Decoder::default();
        decoder.push(&chunk[..chunk.len() - 3]);
        let mut frames = 0;
        while decoder.next_frame().expect("in a test").is_some() {
            frames += 1;
        }
        decoder.push(&chunk[chunk.len() - 3..]);
        while decoder.next_frame().expect("in a test").is_some() {
            frames += 1;
        }
        decoder.finish().expect("in a test");
        assert_eq!(frames, 10_000);
        // Only the half envelope left at the first chunk's end moved.
        assert_eq!(decoder.moved, one.len() - 3);
    }

    #[test]
    fn a_bad_envelope_is_refused() {
        let mut decoder = Decoder::default();
        decoder.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(
            decoder.next_frame(),
            Err(FrameError::TooLarge(u32::MAX as usize))
        );
        let mut decoder = Decoder::default();
        decoder.push(&envelope(FLAG_COMPRESSED, b"x"));
        assert_eq!(decoder.next_frame(), Err(FrameError::Compressed));
        let mut decoder = Decoder::default();
        decoder.push(&[0, 0, 0]);
        assert_eq!(decoder.next_frame(), Ok(None));
        assert_eq!(decoder.finish(), Err(FrameError::Truncated));
        assert_eq!(
            serde_json::to_value(Error::new(Code::InvalidArgument, "x")).expect("in a test")["code"],
            "invalid_argument"
        );
        assert_eq!(
            serde_json::to_value(EndStream::default()).expect("in a test"),
            serde_json::json!({})
        );
    }
}
