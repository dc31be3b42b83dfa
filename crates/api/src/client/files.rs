//! [`Client`]'s methods for a sandbox's files (`/v1/sandboxes/{id}/files`,
//! `crate::files`): bodies streamed both ways, with no overall request
//! timeout (an upload or a download lasts as long as its bytes take); a
//! download that stalls fails after [`STALL_TIMEOUT`] without a byte.

use std::time::Duration;

use reqwest::{Method, Url};
use serde::de::DeserializeOwned;

use super::{Client, ClientError, error_chain};
use crate::files::{
    DirectoryMade, FileList, FileMoved, FileRemoved, FileWritten, MkdirRequest, MoveRequest,
    TarSummary,
};

/// How long a download may go without a byte before it fails (the
/// sandbox's agent gives up on a silent peer after 120 s).
pub const STALL_TIMEOUT: Duration = Duration::from_secs(150);
/// How long a request waits for its answer's headers when it sends no
/// body (a listing, a removal): past it the server is not answering.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(300);

/// Which bytes of a file to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileRange {
    /// From this offset to the end.
    From(u64),
    /// From the first offset to the second, inclusive.
    Span(u64, u64),
    /// The last this many bytes.
    Suffix(u64),
}

impl FileRange {
    /// The `Range` header's value.
    pub fn header(self) -> String {
        match self {
            FileRange::From(first) => format!("bytes={first}-"),
            FileRange::Span(first, last) => format!("bytes={first}-{last}"),
            FileRange::Suffix(count) => format!("bytes=-{count}"),
        }
    }

    /// `A-B`, `A-` or `-N`.
    pub fn parse(text: &str) -> Result<FileRange, String> {
        let invalid = || format!("range {text:?} is not A-B, A- or -N (byte offsets)");
        let (first, last) = text.split_once('-').ok_or_else(invalid)?;
        let number = |t: &str| t.parse::<u64>().map_err(|_| invalid());
        match (first, last) {
            ("", count) => Ok(FileRange::Suffix(number(count)?)),
            (first, "") => Ok(FileRange::From(number(first)?)),
            (first, last) => {
                let (first, last) = (number(first)?, number(last)?);
                if last < first {
                    return Err(invalid());
                }
                Ok(FileRange::Span(first, last))
            }
        }
    }
}

/// A download under way: what the headers said, then the bytes.
#[derive(Debug)]
pub struct FileDownload {
    /// The whole file's size (`x-roost-size`; a tar stream's is unknown).
    pub size: Option<u64>,
    /// Where the bytes start in the file (0 without a range).
    pub offset: u64,
    /// How many bytes come (`Content-Length`), when known.
    pub length: Option<u64>,
    /// Permission bits, octal (`x-roost-mode`).
    pub mode: Option<String>,
    /// `Last-Modified`, as sent.
    pub last_modified: Option<String>,
    received: u64,
    url: String,
    response: reqwest::Response,
}

impl FileDownload {
    /// The next bytes, or `None` at the end. A body shorter than its
    /// `Content-Length` (a download cut at its source) is an error, as is
    /// a stall of [`STALL_TIMEOUT`].
    pub async fn next_chunk(&mut self) -> Result<Option<bytes::Bytes>, ClientError> {
        let chunk = tokio::time::timeout(STALL_TIMEOUT, self.response.chunk()).await;
        let cut = |message: String| ClientError::Unreachable {
            url: self.url.clone(),
            message,
        };
        match chunk {
            Err(_) => Err(cut(format!(
                "the download stalled for {} s",
                STALL_TIMEOUT.as_secs()
            ))),
            Ok(Err(err)) => Err(cut(format!("the download was cut: {}", error_chain(err)))),
            Ok(Ok(Some(bytes))) => {
                self.received += bytes.len() as u64;
                Ok(Some(bytes))
            }
            Ok(Ok(None)) => match self.length {
                Some(length) if length != self.received => Err(cut(format!(
                    "the download was cut: {} of {length} bytes came",
                    self.received
                ))),
                _ => Ok(None),
            },
        }
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }
}

impl Client {
    fn files_url(
        &self,
        sandbox_id: &str,
        suffix: Option<&str>,
        query: &[(&str, String)],
    ) -> Result<Url, ClientError> {
        let mut segments = vec!["v1", "sandboxes", sandbox_id, "files"];
        segments.extend(suffix);
        self.url(&segments, query)
    }

    /// Sends a files request; a 2xx answer (headers read, body not yet).
    async fn files_request(
        &self,
        method: Method,
        url: Url,
        body: Option<(reqwest::Body, &'static str)>,
        headers: &[(reqwest::header::HeaderName, String)],
    ) -> Result<(String, reqwest::Response), ClientError> {
        let shown = url.to_string();
        let mut request = self.http.request(method, url).bearer_auth(&self.token);
        let streaming_up = body.is_some();
        if let Some((body, content_type)) = body {
            request = request
                .header(reqwest::header::CONTENT_TYPE, content_type)
                .body(body);
        }
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let sent = request.send();
        // An upload's answer comes once its last byte is in place, however
        // long that takes; anything else answers in time or not at all.
        let response = if streaming_up {
            sent.await
        } else {
            tokio::time::timeout(ANSWER_TIMEOUT, sent)
                .await
                .map_err(|_| ClientError::Unreachable {
                    url: shown.clone(),
                    message: format!("no answer within {} s", ANSWER_TIMEOUT.as_secs()),
                })?
        }
        .map_err(|e| ClientError::Unreachable {
            url: shown.clone(),
            message: error_chain(e),
        })?;
        let response = Self::successful(response, shown.clone()).await?;
        Ok((shown, response))
    }

    /// A files request whose answer is a JSON record.
    async fn files_record<R: DeserializeOwned>(
        &self,
        method: Method,
        url: Url,
        body: Option<(reqwest::Body, &'static str)>,
    ) -> Result<(u16, R), ClientError> {
        let (shown, response) = self.files_request(method, url, body, &[]).await?;
        let status = response.status().as_u16();
        let record = Self::decoded(response, shown).await?;
        Ok((status, record))
    }

    /// `PUT /v1/sandboxes/{id}/files`: streams `body` into `path` (in
    /// place once whole); whether the file is new (201) and what is there.
    pub async fn put_file(
        &self,
        sandbox_id: &str,
        path: &str,
        body: reqwest::Body,
        mode: Option<&str>,
        parents: bool,
    ) -> Result<(bool, FileWritten), ClientError> {
        let mut query = vec![("path", path.to_owned())];
        if let Some(mode) = mode {
            query.push(("mode", mode.to_owned()));
        }
        query.push(("parents", parents.to_string()));
        let url = self.files_url(sandbox_id, None, &query)?;
        let (status, written) = self
            .files_record(Method::PUT, url, Some((body, "application/octet-stream")))
            .await?;
        Ok((status == 201, written))
    }

    /// `GET /v1/sandboxes/{id}/files`: `path`'s bytes (or `range` of
    /// them), as they come.
    pub async fn get_file(
        &self,
        sandbox_id: &str,
        path: &str,
        range: Option<FileRange>,
    ) -> Result<FileDownload, ClientError> {
        let url = self.files_url(sandbox_id, None, &[("path", path.to_owned())])?;
        let headers: Vec<_> = range
            .map(|range| (reqwest::header::RANGE, range.header()))
            .into_iter()
            .collect();
        let (shown, response) = self.files_request(Method::GET, url, None, &headers).await?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        // `bytes A-B/SIZE` on a 206.
        let offset = header("content-range")
            .and_then(|v| {
                v.strip_prefix("bytes ")?
                    .split_once('-')?
                    .0
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0);
        Ok(FileDownload {
            size: header(crate::files::headers::SIZE).and_then(|v| v.parse().ok()),
            offset,
            length: header("content-length").and_then(|v| v.parse().ok()),
            mode: header(crate::files::headers::MODE),
            last_modified: header("last-modified"),
            received: 0,
            url: shown,
            response,
        })
    }

    /// `GET /v1/sandboxes/{id}/files/list`
    pub async fn list_files(
        &self,
        sandbox_id: &str,
        path: &str,
        depth: u32,
    ) -> Result<FileList, ClientError> {
        let query = [("path", path.to_owned()), ("depth", depth.to_string())];
        let url = self.files_url(sandbox_id, Some("list"), &query)?;
        Ok(self.files_record(Method::GET, url, None).await?.1)
    }

    /// `DELETE /v1/sandboxes/{id}/files`
    pub async fn remove_file(
        &self,
        sandbox_id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<FileRemoved, ClientError> {
        let query = [
            ("path", path.to_owned()),
            ("recursive", recursive.to_string()),
        ];
        let url = self.files_url(sandbox_id, None, &query)?;
        Ok(self.files_record(Method::DELETE, url, None).await?.1)
    }

    /// `POST /v1/sandboxes/{id}/files/move`
    pub async fn move_file(
        &self,
        sandbox_id: &str,
        request: &MoveRequest,
    ) -> Result<FileMoved, ClientError> {
        let url = self.files_url(sandbox_id, Some("move"), &[])?;
        Ok(self
            .files_record(Method::POST, url, Some(json_body(request)?))
            .await?
            .1)
    }

    /// `POST /v1/sandboxes/{id}/files/mkdir`
    pub async fn make_dir(
        &self,
        sandbox_id: &str,
        request: &MkdirRequest,
    ) -> Result<DirectoryMade, ClientError> {
        let url = self.files_url(sandbox_id, Some("mkdir"), &[])?;
        Ok(self
            .files_record(Method::POST, url, Some(json_body(request)?))
            .await?
            .1)
    }

    /// `GET /v1/sandboxes/{id}/files/tar`: directory `path` as a tar
    /// stream, as it comes.
    pub async fn get_tar(&self, sandbox_id: &str, path: &str) -> Result<FileDownload, ClientError> {
        let url = self.files_url(sandbox_id, Some("tar"), &[("path", path.to_owned())])?;
        let (shown, response) = self.files_request(Method::GET, url, None, &[]).await?;
        Ok(FileDownload {
            size: None,
            offset: 0,
            length: None,
            mode: None,
            last_modified: None,
            received: 0,
            url: shown,
            response,
        })
    }

    /// `PUT /v1/sandboxes/{id}/files/tar`: unpacks the tar stream `body`
    /// under directory `path`.
    pub async fn put_tar(
        &self,
        sandbox_id: &str,
        path: &str,
        body: reqwest::Body,
    ) -> Result<TarSummary, ClientError> {
        let url = self.files_url(sandbox_id, Some("tar"), &[("path", path.to_owned())])?;
        Ok(self
            .files_record(Method::PUT, url, Some((body, "application/x-tar")))
            .await?
            .1)
    }
}

fn json_body<T: serde::Serialize>(value: &T) -> Result<(reqwest::Body, &'static str), ClientError> {
    let bytes = serde_json::to_vec(value).map_err(|e| ClientError::Encode {
        message: e.to_string(),
    })?;
    Ok((reqwest::Body::from(bytes), "application/json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_render_as_headers() {
        assert_eq!(FileRange::parse("0-99"), Ok(FileRange::Span(0, 99)));
        assert_eq!(FileRange::parse("5-"), Ok(FileRange::From(5)));
        assert_eq!(FileRange::parse("-7"), Ok(FileRange::Suffix(7)));
        for bad in ["", "-", "9-3", "a-b", "1"] {
            assert!(FileRange::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(FileRange::Span(1, 2).header(), "bytes=1-2");
        assert_eq!(FileRange::Suffix(3).header(), "bytes=-3");
    }
}
