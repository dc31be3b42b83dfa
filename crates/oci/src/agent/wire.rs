//! The agent protocol's frames: `[kind: u8][length: u32, big-endian]
//! [payload]`, the payload at most [`FRAME_BYTES_MAX`]. Control payloads
//! are JSON objects (built and read through `serde_json::Value`, no
//! derive); output and stdin payloads are raw bytes. A peer that sends a
//! frame past the bound, or of an unknown kind where a control frame is
//! expected, gets an error frame and the connection is closed: the agent
//! runs inside the sandbox and the runner treats every frame as hostile.

use std::io;

use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest payload of one frame.
pub const FRAME_BYTES_MAX: usize = 1024 * 1024;

/// Frame kinds. Runner → agent below 64, agent → runner from 64, but
/// [`kind::DATA`]: a file's (or tar stream's) bytes, which flow the way
/// the connection's request says.
pub mod kind {
    /// First frame of a command connection: run (or attach to) a command.
    pub const RUN: u8 = 1;
    /// Output taken (durably) up to these offsets: the agent frees it.
    pub const ACK: u8 = 2;
    /// Deliver a signal to the command's process group.
    pub const SIGNAL: u8 = 3;
    /// The runner recorded the command's end: the agent forgets it.
    pub const FORGET: u8 = 4;
    /// First frame of a stdin connection: which command.
    pub const STDIN_OPEN: u8 = 5;
    /// Bytes for the command's stdin.
    pub const STDIN_DATA: u8 = 6;
    /// Close the command's stdin (end of input).
    pub const STDIN_CLOSE: u8 = 7;
    /// First frame of a listing connection.
    pub const LIST: u8 = 8;
    /// Set the size of a command's terminal: `{id, rows, cols}`.
    pub const RESIZE: u8 = 19;
    /// First frame of a file download: `{path, offset, length?}`.
    pub const FILE_READ: u8 = 9;
    /// First frame of a file upload: `{path, mode?, parents}`.
    pub const FILE_WRITE: u8 = 10;
    /// First frame of a file listing: `{path, depth?}`.
    pub const FILE_LIST: u8 = 11;
    /// First frame of a removal: `{path, recursive}`.
    pub const FILE_REMOVE: u8 = 12;
    /// First frame of a rename: `{from, to, overwrite}`.
    pub const FILE_MOVE: u8 = 13;
    /// First frame of a directory creation: `{path, parents, mode?}`.
    pub const FILE_MKDIR: u8 = 14;
    /// First frame of a directory download as a tar stream: `{path}`.
    pub const TAR_READ: u8 = 15;
    /// First frame of a tar stream unpacked under a directory: `{path}`.
    pub const TAR_WRITE: u8 = 16;
    /// Raw bytes of a file or a tar stream, either way: the runner's for
    /// `FILE_WRITE` and `TAR_WRITE`, the agent's for `FILE_READ` and
    /// `TAR_READ`.
    pub const DATA: u8 = 17;
    /// The runner's upload is complete (after its last `DATA` frame).
    pub const DATA_END: u8 = 18;

    /// The command runs: its pid (in the sandbox) and whether this
    /// request started it.
    pub const STARTED: u8 = 64;
    /// Bytes of the command's stdout, in order from the asked offset.
    pub const STDOUT: u8 = 65;
    /// Bytes of the command's stderr, in order from the asked offset.
    pub const STDERR: u8 = 66;
    /// The command ended (after its last output frame).
    pub const ENDED: u8 = 67;
    /// The command could not start.
    pub const LAUNCH_FAILED: u8 = 68;
    /// A request refused: `{code, message}`; the connection then closes.
    pub const ERROR: u8 = 69;
    /// Done (stdin closed).
    pub const OK: u8 = 70;
    /// A listing's answer: the commands (`LIST`), or a part of the
    /// entries (`FILE_LIST`, several frames then `DONE`).
    pub const LISTING: u8 = 71;
    /// A file download's first answer: `{size, mode, mtime_unix_ms, type}`.
    pub const FILE_INFO: u8 = 72;
    /// A file operation is complete; its summary (for example `{size}`).
    pub const DONE: u8 = 73;
}

/// One frame as read.
#[derive(Debug)]
pub struct Frame {
    pub kind: u8,
    pub payload: Vec<u8>,
}

impl Frame {
    /// The payload as a JSON object; an error names the frame.
    pub fn json(&self) -> io::Result<Value> {
        let value: Value = serde_json::from_slice(&self.payload)
            .map_err(|e| invalid(format!("frame {} is not JSON: {e}", self.kind)))?;
        if !value.is_object() {
            return Err(invalid(format!("frame {} is not a JSON object", self.kind)));
        }
        Ok(value)
    }
}

pub fn invalid(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// Reads one frame; `None` at a clean end between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R) -> io::Result<Option<Frame>> {
    let mut header = [0u8; 5];
    let mut filled = 0;
    while filled < header.len() {
        let n = reader.read(&mut header[filled..]).await?;
        if n == 0 {
            return if filled == 0 {
                Ok(None)
            } else {
                Err(io::ErrorKind::UnexpectedEof.into())
            };
        }
        filled += n;
    }
    let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if length > FRAME_BYTES_MAX {
        return Err(invalid(format!(
            "a frame of {length} bytes is past the bound of {FRAME_BYTES_MAX}"
        )));
    }
    let mut payload = vec![0u8; length];
    reader.read_exact(&mut payload).await?;
    Ok(Some(Frame {
        kind: header[0],
        payload,
    }))
}

/// Frames read one after another from one stream, safe to cancel: the
/// bytes of a frame that had only partly arrived when a `select!` took
/// another branch stay here for the next call. [`read_frame`] keeps them
/// in its own future, so a cancelled call loses them and the stream then
/// reads payload bytes as headers (a command's output could forge its
/// end). Holds at most one frame and what arrived with it. Frames are
/// taken from an offset into what was read, and what is left moved down
/// only before the next read: a peer sending many tiny frames at once
/// costs a copy of each, not of everything behind it.
pub struct FrameReader<R> {
    inner: R,
    buffer: Vec<u8>,
    /// Where the next frame starts in `buffer`.
    start: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R) -> Self {
        FrameReader {
            inner,
            buffer: Vec::new(),
            start: 0,
        }
    }

    /// The length of the whole frame at the front of what was read (its
    /// header's length plus five), once its header is there.
    fn front_frame_bytes(&self) -> io::Result<Option<usize>> {
        let Some(header) = self.buffer.get(self.start..self.start + 5) else {
            return Ok(None);
        };
        let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        if length > FRAME_BYTES_MAX {
            return Err(invalid(format!(
                "a frame of {length} bytes is past the bound of {FRAME_BYTES_MAX}"
            )));
        }
        Ok(Some(5 + length))
    }

    /// Whether a whole frame was read already: [`FrameReader::next`]
    /// answers it without reading (a caller acknowledging what it took
    /// may wait until none is left, once per read instead of per frame).
    pub fn holds_a_frame(&self) -> bool {
        matches!(self.front_frame_bytes(), Ok(Some(bytes)) if self.buffer.len() - self.start >= bytes)
    }

    /// The next frame; `None` at a clean end between frames. Cancel safe.
    pub async fn next(&mut self) -> io::Result<Option<Frame>> {
        loop {
            let front = self.front_frame_bytes()?;
            if let Some(bytes) = front
                && self.buffer.len() - self.start >= bytes
            {
                let frame = &self.buffer[self.start..self.start + bytes];
                let (kind, payload) = (frame[0], frame[5..].to_vec());
                self.start += bytes;
                return Ok(Some(Frame { kind, payload }));
            }
            // Not whole yet: what is left goes to the front, then more is
            // read (the header first, then the rest of the frame).
            let wanted = front.unwrap_or(5);
            self.buffer.drain(..self.start);
            self.start = 0;
            self.buffer
                .reserve((wanted - self.buffer.len()).max(8 * 1024));
            // `read_buf` is cancel safe: a cancelled call read nothing.
            if self.inner.read_buf(&mut self.buffer).await? == 0 {
                return if self.buffer.is_empty() {
                    Ok(None)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
        }
    }
}

/// Writes one frame (header and payload in one write where it fits).
pub async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    kind: u8,
    payload: &[u8],
) -> io::Result<()> {
    if payload.len() > FRAME_BYTES_MAX {
        return Err(invalid("frame payload past the bound"));
    }
    let mut bytes = Vec::with_capacity(5 + payload.len());
    bytes.push(kind);
    bytes.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    bytes.extend_from_slice(payload);
    writer.write_all(&bytes).await
}

/// Writes a JSON control frame.
pub async fn write_json<W: AsyncWrite + Unpin>(
    writer: &mut W,
    kind: u8,
    value: &Value,
) -> io::Result<()> {
    write_frame(writer, kind, value.to_string().as_bytes()).await
}

/// An error frame: a stable code and a one-line message.
pub async fn write_error<W: AsyncWrite + Unpin>(
    writer: &mut W,
    code: &str,
    message: &str,
) -> io::Result<()> {
    let value = serde_json::json!({"code": code, "message": message});
    write_json(writer, kind::ERROR, &value).await
}

/// `value[name]` as a string, or an error naming the field.
pub fn text<'a>(value: &'a Value, name: &str) -> io::Result<&'a str> {
    value[name]
        .as_str()
        .ok_or_else(|| invalid(format!("field {name:?} is not a string")))
}

/// `value[name]` as an unsigned integer (absent: 0).
pub fn number(value: &Value, name: &str) -> io::Result<u64> {
    match &value[name] {
        Value::Null => Ok(0),
        other => other
            .as_u64()
            .ok_or_else(|| invalid(format!("field {name:?} is not an unsigned integer"))),
    }
}

/// `value[name]` as a list of strings (absent: empty).
pub fn texts(value: &Value, name: &str) -> io::Result<Vec<String>> {
    match &value[name] {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|item| {
                item.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| invalid(format!("field {name:?} holds a non-string")))
            })
            .collect(),
        _ => Err(invalid(format!("field {name:?} is not a list"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_oversized_ones_are_refused() {
        let mut bytes = Vec::new();
        write_frame(&mut bytes, kind::STDOUT, b"hello")
            .await
            .expect("ok");
        write_json(&mut bytes, kind::ACK, &serde_json::json!({"stdout": 5}))
            .await
            .expect("ok");
        let mut reader = bytes.as_slice();
        let first = read_frame(&mut reader)
            .await
            .expect("read")
            .expect("a frame");
        assert_eq!(
            (first.kind, first.payload.as_slice()),
            (kind::STDOUT, &b"hello"[..])
        );
        let second = read_frame(&mut reader)
            .await
            .expect("read")
            .expect("a frame");
        assert_eq!(
            number(&second.json().expect("ok"), "stdout").expect("ok"),
            5
        );
        assert!(read_frame(&mut reader).await.expect("ok").is_none());

        let mut huge = vec![kind::STDIN_DATA];
        huge.extend_from_slice(&(FRAME_BYTES_MAX as u32 + 1).to_be_bytes());
        let err = read_frame(&mut huge.as_slice()).await.expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        let torn = [kind::STDOUT, 0, 0];
        assert!(read_frame(&mut torn.as_slice()).await.is_err());
        let not_object = Frame {
            kind: kind::RUN,
            payload: b"[1]".to_vec(),
        };
        assert!(not_object.json().is_err());
    }

    /// A peer's many tiny frames, arrived in one read, are each taken
    /// from where the last ended (the rest is moved once, before the next
    /// read), and the reader says while a whole frame is still held, so
    /// its caller acknowledges once per read.
    #[tokio::test]
    async fn a_frame_reader_takes_many_small_frames_of_one_read_in_order() {
        let mut bytes = Vec::new();
        for i in 0..50_000u32 {
            let payload = if i % 2 == 0 {
                Vec::new()
            } else {
                i.to_be_bytes().to_vec()
            };
            write_frame(&mut bytes, kind::STDOUT, &payload)
                .await
                .expect("ok");
        }
        // The last frame arrives in part: held back until the rest comes.
        write_frame(&mut bytes, kind::STDERR, b"tail")
            .await
            .expect("ok");
        let (whole, cut) = bytes.split_at(bytes.len() - 2);
        let mut frames = FrameReader::new(whole.chain(cut));
        for i in 0..50_000u32 {
            let frame = frames.next().await.expect("read").expect("a frame");
            let expected = if i % 2 == 0 {
                Vec::new()
            } else {
                i.to_be_bytes().to_vec()
            };
            assert_eq!((frame.kind, frame.payload), (kind::STDOUT, expected));
        }
        let tail = frames.next().await.expect("read").expect("a frame");
        assert_eq!(
            (tail.kind, tail.payload.as_slice()),
            (kind::STDERR, &b"tail"[..])
        );
        assert!(!frames.holds_a_frame());
        assert!(frames.next().await.expect("clean end").is_none());

        let mut two = Vec::new();
        for _ in 0..2 {
            write_frame(&mut two, kind::STDOUT, b"x").await.expect("ok");
        }
        let mut frames = FrameReader::new(two.as_slice());
        frames.next().await.expect("read").expect("a frame");
        assert!(frames.holds_a_frame(), "the second came with the first");
        frames.next().await.expect("read").expect("a frame");
        assert!(!frames.holds_a_frame());
    }

    #[tokio::test]
    async fn a_frame_reader_keeps_a_partly_read_frame_across_a_cancelled_read() {
        let mut frame = Vec::new();
        write_frame(&mut frame, kind::STDOUT, &[7u8; 40_000])
            .await
            .expect("ok");
        write_json(
            &mut frame,
            kind::ENDED,
            &serde_json::json!({"exit_code": 0}),
        )
        .await
        .expect("ok");
        let (mut agent, runner) = tokio::io::duplex(1 << 20);
        let mut frames = FrameReader::new(runner);
        // The header and part of the payload arrive; then another branch
        // (a signal, a timer) wins the select and the read is dropped.
        agent.write_all(&frame[..5 + 10_000]).await.expect("write");
        let (signals, mut signalled) = tokio::sync::mpsc::channel::<()>(1);
        signals.send(()).await.expect("send");
        let mut reads = 0;
        loop {
            tokio::select! {
                biased;
                _ = frames.next() => panic!("a frame from a partial payload"),
                Some(()) = signalled.recv() => {
                    reads += 1;
                    // Let the partial bytes be read before the next cancel.
                    if reads < 3 {
                        tokio::task::yield_now().await;
                        signals.send(()).await.expect("send");
                    } else {
                        break;
                    }
                }
            }
        }
        agent.write_all(&frame[5 + 10_000..]).await.expect("write");
        let first = frames.next().await.expect("read").expect("a frame");
        assert_eq!(first.kind, kind::STDOUT);
        assert_eq!(first.payload, vec![7u8; 40_000]);
        let second = frames.next().await.expect("read").expect("a frame");
        assert_eq!(second.kind, kind::ENDED);
        drop(agent);
        assert!(frames.next().await.expect("clean end").is_none());

        // A torn frame at the end is an error; an oversized one is refused.
        let (mut agent, runner) = tokio::io::duplex(64);
        let mut frames = FrameReader::new(runner);
        agent
            .write_all(&[kind::STDOUT, 0, 0, 0, 9, 1])
            .await
            .expect("write");
        drop(agent);
        assert!(frames.next().await.is_err());
        let mut huge = vec![kind::STDOUT];
        huge.extend_from_slice(&(FRAME_BYTES_MAX as u32 + 1).to_be_bytes());
        let mut frames = FrameReader::new(huge.as_slice());
        let err = frames.next().await.expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
    }
}
