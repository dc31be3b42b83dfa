//! A streaming `multipart/form-data` reader for envd's upload (`POST
//! /files`), which the SDK sends for in-memory data: parts one after the
//! other, each body handed on in chunks as it arrives, never held whole
//! (at most a delimiter's length is kept back to find the next one).

use axum::body::Bytes;
use futures::{Stream, StreamExt};

/// The most header bytes a part may have.
const PART_HEADERS_BYTES_MAX: usize = 16 * 1024;
/// The longest boundary RFC 2046 allows (section 5.1.1). The reader keeps
/// a delimiter's length back from every chunk and searches it for the
/// delimiter each time more arrives: a boundary of 400 KB sent with a body
/// in 1-byte chunks made every byte cost 400 KB of work.
pub const BOUNDARY_BYTES_MAX: usize = 70;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum MultipartError {
    #[error("the multipart body ended early")]
    Truncated,
    #[error("a multipart part's headers are malformed or over {PART_HEADERS_BYTES_MAX} bytes")]
    BadHeaders,
    #[error("the body could not be read: {0}")]
    Body(String),
    #[error("the multipart boundary is longer than {BOUNDARY_BYTES_MAX} characters (RFC 2046)")]
    BoundaryTooLong,
}

/// A part's headers that matter: its form name and file name.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Part {
    pub name: Option<String>,
    pub filename: Option<String>,
}

#[derive(Debug, PartialEq, Eq)]
enum Place {
    /// Before a part's headers (just after a delimiter).
    AfterDelimiter,
    /// In a part's body.
    Body,
    Done,
}

pub struct Multipart<S> {
    stream: S,
    buffer: Vec<u8>,
    /// `\r\n--BOUNDARY`
    delimiter: Vec<u8>,
    place: Place,
    eof: bool,
}

/// The boundary of a `multipart/form-data` content type (`None`: not
/// one), refused when longer than RFC 2046 allows.
pub fn boundary(content_type: &str) -> Result<Option<String>, MultipartError> {
    let Some((kind, params)) = content_type.split_once(';') else {
        return Ok(None);
    };
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return Ok(None);
    }
    let boundary = params.split(';').find_map(|param| {
        let (key, value) = param.split_once('=')?;
        key.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| value.trim().trim_matches('"').to_owned())
            .filter(|b| !b.is_empty())
    });
    if boundary
        .as_ref()
        .is_some_and(|b| b.len() > BOUNDARY_BYTES_MAX)
    {
        return Err(MultipartError::BoundaryTooLong);
    }
    Ok(boundary)
}

impl<S, E> Multipart<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    pub fn new(stream: S, boundary: &str) -> Multipart<S> {
        Multipart {
            stream,
            // The first delimiter has no CRLF before it: one is supplied so
            // that every delimiter reads alike.
            buffer: b"\r\n".to_vec(),
            delimiter: format!("\r\n--{boundary}").into_bytes(),
            place: Place::Body,
            eof: false,
        }
    }

    async fn fill(&mut self) -> Result<bool, MultipartError> {
        if self.eof {
            return Ok(false);
        }
        match self.stream.next().await {
            Some(Ok(bytes)) => {
                self.buffer.extend_from_slice(&bytes);
                Ok(true)
            }
            Some(Err(err)) => Err(MultipartError::Body(err.to_string())),
            None => {
                self.eof = true;
                Ok(false)
            }
        }
    }

    /// Where `needle` first is in the buffer at or after `from`.
    fn find(&self, needle: &[u8], from: usize) -> Option<usize> {
        self.buffer[from.min(self.buffer.len())..]
            .windows(needle.len())
            .position(|window| window == needle)
            .map(|at| at + from)
    }

    /// The next part's headers; `None` after the last part. Whatever is
    /// left of the current part's body is skipped.
    pub async fn next_part(&mut self) -> Result<Option<Part>, MultipartError> {
        while self.place == Place::Body {
            if self.next_chunk().await?.is_none() && self.place == Place::Body {
                return Err(MultipartError::Truncated);
            }
        }
        if self.place == Place::Done {
            return Ok(None);
        }
        // After a delimiter: `--` ends the body, CRLF starts a part.
        while self.buffer.len() < 2 {
            if !self.fill().await? {
                return Err(MultipartError::Truncated);
            }
        }
        if self.buffer.starts_with(b"--") {
            self.place = Place::Done;
            return Ok(None);
        }
        let mut from = 0;
        let headers_end = loop {
            if let Some(at) = self.find(b"\r\n\r\n", from) {
                break at;
            }
            // Only what arrives next, with the 3 bytes before it, is new
            // to search: headers sent a byte at a time cost no rescans.
            from = self.buffer.len().saturating_sub(3);
            if self.buffer.len() > PART_HEADERS_BYTES_MAX {
                return Err(MultipartError::BadHeaders);
            }
            if !self.fill().await? {
                return Err(MultipartError::Truncated);
            }
        };
        let head = String::from_utf8_lossy(&self.buffer[..headers_end]).into_owned();
        self.buffer.drain(..headers_end + 4);
        self.place = Place::Body;
        let mut part = Part::default();
        for line in head.split("\r\n").filter(|l| !l.is_empty()) {
            let (name, value) = line.split_once(':').ok_or(MultipartError::BadHeaders)?;
            if name.trim().eq_ignore_ascii_case("content-disposition") {
                part.name = parameter(value, "name");
                part.filename = parameter(value, "filename");
            }
        }
        Ok(Some(part))
    }

    /// The next bytes of the current part's body; `None` at its end.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, MultipartError> {
        if self.place != Place::Body {
            return Ok(None);
        }
        loop {
            if let Some(at) = self.find(&self.delimiter, 0) {
                let chunk: Vec<u8> = self.buffer.drain(..at).collect();
                self.buffer.drain(..self.delimiter.len());
                self.place = Place::AfterDelimiter;
                return Ok((!chunk.is_empty()).then_some(chunk).or(None));
            }
            // Keep back what could be the start of a delimiter.
            let safe = self.buffer.len().saturating_sub(self.delimiter.len() - 1);
            if safe > 0 {
                return Ok(Some(self.buffer.drain(..safe).collect()));
            }
            if !self.fill().await? {
                return Err(MultipartError::Truncated);
            }
        }
    }
}

/// `key="value"` (or unquoted) from a header's parameters.
fn parameter(value: &str, key: &str) -> Option<String> {
    value.split(';').skip(1).find_map(|param| {
        let (k, v) = param.split_once('=')?;
        if !k.trim().eq_ignore_ascii_case(key) {
            return None;
        }
        let v = v.trim();
        let v = v
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(v);
        Some(v.replace("\\\"", "\"").replace("%22", "\""))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body() -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/a.bin\"\r\nContent-Type: application/octet-stream\r\n\r\n");
        body.extend_from_slice(b"\x00\x01\r\n--X\r\n\xff");
        body.extend_from_slice(b"\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.txt\"\r\n\r\n");
        body.extend_from_slice(b"hello");
        body.extend_from_slice(b"\r\n--XyZ--\r\n");
        body
    }

    async fn parse(chunk: usize) -> Vec<(Part, Vec<u8>)> {
        let body = body();
        let chunks: Vec<Result<Bytes, String>> = body
            .chunks(chunk)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let mut reader = Multipart::new(futures::stream::iter(chunks), "XyZ");
        let mut parts = Vec::new();
        while let Some(part) = reader.next_part().await.expect("in a test") {
            let mut data = Vec::new();
            while let Some(chunk) = reader.next_chunk().await.expect("in a test") {
                data.extend(chunk);
            }
            parts.push((part, data));
        }
        parts
    }

    #[tokio::test]
    async fn parts_come_out_whole_however_the_body_is_cut() {
        for chunk in [1, 2, 3, 7, 64, 4096] {
            let parts = parse(chunk).await;
            assert_eq!(parts.len(), 2, "chunks of {chunk}");
            assert_eq!(parts[0].0.filename.as_deref(), Some("/tmp/a.bin"));
            assert_eq!(parts[0].0.name.as_deref(), Some("file"));
            assert_eq!(parts[0].1, b"\x00\x01\r\n--X\r\n\xff");
            assert_eq!(parts[1].0.filename.as_deref(), Some("b.txt"));
            assert_eq!(parts[1].1, b"hello");
        }
    }

    #[tokio::test]
    async fn a_cut_body_is_an_error() {
        let body = body();
        let cut = vec![Ok::<_, String>(Bytes::copy_from_slice(
            &body[..body.len() - 20],
        ))];
        let mut reader = Multipart::new(futures::stream::iter(cut), "XyZ");
        let mut outcome = Ok(());
        while outcome.is_ok() {
            match reader.next_part().await {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(err) => outcome = Err(err),
            }
        }
        assert_eq!(outcome, Err(MultipartError::Truncated));
        assert_eq!(
            boundary("multipart/form-data; boundary=\"ab c\""),
            Ok(Some("ab c".to_owned()))
        );
        assert_eq!(boundary("application/json"), Ok(None));
    }

    /// Audit finding: no bound on the boundary, so one of 400 KB with a
    /// body in 1-byte chunks cost 400 KB of searching per byte. RFC 2046's
    /// 70 characters are accepted, one more refused.
    #[test]
    fn a_boundary_longer_than_rfc_2046_allows_is_refused() {
        let longest = "b".repeat(BOUNDARY_BYTES_MAX);
        let content_type = |b: &str| format!("multipart/form-data; boundary={b}");
        assert_eq!(boundary(&content_type(&longest)), Ok(Some(longest.clone())));
        let quoted = format!("multipart/form-data; boundary=\"{longest}x\"");
        for refused in [content_type(&format!("{longest}x")), quoted] {
            assert_eq!(boundary(&refused), Err(MultipartError::BoundaryTooLong));
        }
    }
}
