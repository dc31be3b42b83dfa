//! The runner's side of the agent's file operations (see [`super`] and
//! [`super::files`]): a sandbox's files read, written, listed, removed,
//! moved, and directories as tar streams, all executed by the agent inside
//! the sandbox. What the agent answers is bounded and checked like every
//! other frame from it: it runs with the sandbox's privileges.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use super::files::{DATA_BYTES_MAX, LIST_ENTRIES_MAX, LIST_JSON_BYTES_MAX};
use super::wire::{self, Frame, kind};
use crate::error::{Error, Result};
use crate::runtime::Sandbox;

/// How long the agent may stay silent within a file operation (a frame of
/// a download, the answer after an upload's fsync, a recursive removal): a
/// frozen or dead sandbox must not hang the runner.
pub const FILE_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// The most JSON a listing may take in all: the agent stops its entries at
/// [`LIST_JSON_BYTES_MAX`] and says `truncated`; what is more is the
/// frames' own (a bound for them with room to spare). More is a lying
/// agent's.
pub const LISTING_BYTES_MAX: usize = LIST_JSON_BYTES_MAX + 1024 * 1024;

/// What a directory entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    File,
    Directory,
    Symlink,
    /// A fifo, socket or device node.
    Other,
}

impl FileKind {
    fn parse(text: Option<&str>) -> FileKind {
        match text {
            Some("file") => FileKind::File,
            Some("directory") => FileKind::Directory,
            Some("symlink") => FileKind::Symlink,
            _ => FileKind::Other,
        }
    }

    /// The wire name (`file`, `directory`, `symlink`, `other`).
    pub fn as_str(self) -> &'static str {
        match self {
            FileKind::File => "file",
            FileKind::Directory => "directory",
            FileKind::Symlink => "symlink",
            FileKind::Other => "other",
        }
    }
}

/// A file as a download describes it before its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileInfo {
    /// The whole file's size (not the part asked for).
    pub size: u64,
    /// Permission bits (with setuid, setgid and sticky as they are).
    pub mode: u32,
    pub mtime_unix_ms: i64,
    pub kind: FileKind,
}

/// One entry of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    /// Absolute, in the sandbox.
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
    pub mtime_unix_ms: i64,
    /// A symlink's target, as written (never followed).
    pub link_target: Option<String>,
}

/// A listing: entries sorted by path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileListing {
    pub entries: Vec<FileEntry>,
    /// More entries exist than the agent answers ([`LIST_ENTRIES_MAX`]).
    pub truncated: bool,
}

/// What a tar stream moved, either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TarSummary {
    /// Regular files (and hard links).
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    /// The regular files' bytes.
    pub bytes: u64,
    /// Entries neither packed nor unpacked: device nodes, fifos, sockets.
    pub skipped: u64,
}

impl TarSummary {
    fn parse(value: &Value) -> TarSummary {
        let number = |name: &str| value[name].as_u64().unwrap_or(0);
        TarSummary {
            files: number("files"),
            directories: number("directories"),
            symlinks: number("symlinks"),
            bytes: number("bytes"),
            skipped: number("skipped"),
        }
    }
}

impl Sandbox {
    /// Connects and sends a file request.
    async fn file_request(&self, first: u8, body: &Value) -> Result<Connection> {
        let stream = self.connect_agent().await?;
        let (reader, writer) = stream.into_split();
        let mut connection = Connection {
            sandbox: self.clone(),
            reader,
            writer,
        };
        connection.send_json(first, body).await?;
        Ok(connection)
    }

    /// Reads `path` from `offset`, at most `length` bytes (all to the end
    /// without): its [`FileInfo`], then its bytes from the download.
    /// `offset_past_end` when `offset` is past the size.
    pub async fn agent_read_file(
        &self,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> Result<(FileInfo, AgentDownload)> {
        let mut request = json!({"path": path, "offset": offset});
        if let Some(length) = length {
            request["length"] = json!(length);
        }
        let mut connection = self.file_request(kind::FILE_READ, &request).await?;
        let answer = connection.answer(&[kind::FILE_INFO]).await?;
        let value = connection.json(&answer)?;
        let info = FileInfo {
            size: value["size"].as_u64().unwrap_or(0),
            mode: value["mode"]
                .as_u64()
                .and_then(|m| u32::try_from(m).ok())
                .unwrap_or(0),
            mtime_unix_ms: value["mtime_unix_ms"].as_i64().unwrap_or(0),
            kind: FileKind::parse(value["type"].as_str()),
        };
        let expected = info
            .size
            .saturating_sub(offset)
            .min(length.unwrap_or(u64::MAX));
        Ok((
            info,
            AgentDownload {
                connection,
                expected: Some(expected),
                received: 0,
                pending: None,
                done: None,
            },
        ))
    }

    /// Writes `path` with the bytes given to the returned writer; `mode`'s
    /// permission bits (0644 without; setuid, setgid and sticky never),
    /// missing parent directories made (0755) with `parents`. Nothing is
    /// under `path` but its old content until [`FileWriter::finish`] says
    /// the new one is in place.
    pub async fn agent_write_file(
        &self,
        path: &str,
        mode: Option<u32>,
        parents: bool,
    ) -> Result<FileWriter> {
        let mut request = json!({"path": path, "parents": parents});
        if let Some(mode) = mode {
            request["mode"] = json!(mode);
        }
        let connection = self.file_request(kind::FILE_WRITE, &request).await?;
        Ok(FileWriter {
            upload: Upload { connection },
        })
    }

    /// Lists `path` down to `depth` levels (1 = its own entries; a file or
    /// a symlink is its own one entry), never following a symlink.
    pub async fn agent_list(&self, path: &str, depth: u32) -> Result<FileListing> {
        let request = json!({"path": path, "depth": depth});
        let mut connection = self.file_request(kind::FILE_LIST, &request).await?;
        let mut listing = FileListing::default();
        let mut bytes = 0usize;
        loop {
            let frame = connection.answer(&[kind::LISTING, kind::DONE]).await?;
            bytes += frame.payload.len();
            if bytes > LISTING_BYTES_MAX {
                return Err(connection.bad_answer("a listing past its bound"));
            }
            let value = connection.json(&frame)?;
            if frame.kind == kind::DONE {
                listing.truncated = value["truncated"].as_bool().unwrap_or(false);
                return Ok(listing);
            }
            for item in value["entries"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or(&[])
            {
                if listing.entries.len() >= LIST_ENTRIES_MAX {
                    return Err(connection.bad_answer("a listing past its bound"));
                }
                let Some(path) = item["path"].as_str() else {
                    return Err(connection.bad_answer("an entry without a path"));
                };
                listing.entries.push(FileEntry {
                    path: path.to_owned(),
                    kind: FileKind::parse(item["type"].as_str()),
                    size: item["size"].as_u64().unwrap_or(0),
                    mode: item["mode"]
                        .as_u64()
                        .and_then(|m| u32::try_from(m).ok())
                        .unwrap_or(0),
                    mtime_unix_ms: item["mtime_unix_ms"].as_i64().unwrap_or(0),
                    link_target: item["link_target"].as_str().map(str::to_owned),
                });
            }
        }
    }

    /// Removes a file or a symlink (never what it points at), or a
    /// directory (a non-empty one only when `recursive`).
    pub async fn agent_remove(&self, path: &str, recursive: bool) -> Result<()> {
        let request = json!({"path": path, "recursive": recursive});
        let mut connection = self.file_request(kind::FILE_REMOVE, &request).await?;
        connection.answer(&[kind::DONE]).await?;
        Ok(())
    }

    /// Renames `from` to `to` (an existing `to` is replaced only when
    /// `overwrite`; `cross_device` across filesystems).
    pub async fn agent_move(&self, from: &str, to: &str, overwrite: bool) -> Result<()> {
        let request = json!({"from": from, "to": to, "overwrite": overwrite});
        let mut connection = self.file_request(kind::FILE_MOVE, &request).await?;
        connection.answer(&[kind::DONE]).await?;
        Ok(())
    }

    /// Makes directory `path` with `mode`'s permission bits (0755
    /// without), and its missing parents with `parents` (then an existing
    /// directory is fine). Whether it was made.
    pub async fn agent_mkdir(&self, path: &str, parents: bool, mode: Option<u32>) -> Result<bool> {
        let mut request = json!({"path": path, "parents": parents});
        if let Some(mode) = mode {
            request["mode"] = json!(mode);
        }
        let mut connection = self.file_request(kind::FILE_MKDIR, &request).await?;
        let done = connection.answer(&[kind::DONE]).await?;
        Ok(connection.json(&done)?["created"]
            .as_bool()
            .unwrap_or(false))
    }

    /// Directory `path` as a tar stream (regular files, directories,
    /// symlinks as links; modes without setuid, setgid and sticky).
    /// [`AgentDownload::tar_summary`] tells what it held once read.
    pub async fn agent_tar_read(&self, path: &str) -> Result<AgentDownload> {
        let mut connection = self
            .file_request(kind::TAR_READ, &json!({"path": path}))
            .await?;
        // The first frame before the call returns: a refusal (no such
        // directory) comes back here, before any byte of the stream.
        let first = connection.answer(&[kind::DATA, kind::DONE]).await?;
        Ok(AgentDownload {
            connection,
            expected: None,
            received: 0,
            pending: Some(first),
            done: None,
        })
    }

    /// Unpacks the tar stream given to the returned writer under directory
    /// `path` (made where missing). See [`super::files`] for what is
    /// refused or neutralised; a refused or broken stream leaves what came
    /// before it unpacked.
    pub async fn agent_tar_write(&self, path: &str) -> Result<TarWriter> {
        let connection = self
            .file_request(kind::TAR_WRITE, &json!({"path": path}))
            .await?;
        Ok(TarWriter {
            upload: Upload { connection },
        })
    }
}

/// One connection to the agent for a file operation.
#[derive(Debug)]
struct Connection {
    sandbox: Sandbox,
    reader: OwnedReadHalf,
    writer: OwnedWriteHalf,
}

impl Connection {
    fn unreachable(&self, message: impl Into<String>) -> Error {
        self.sandbox.agent_error("unreachable", message)
    }

    fn bad_answer(&self, message: impl Into<String>) -> Error {
        self.sandbox.agent_error("bad_answer", message)
    }

    fn json(&self, frame: &Frame) -> Result<Value> {
        frame.json().map_err(|e| self.bad_answer(e.to_string()))
    }

    async fn send_json(&mut self, kind: u8, body: &Value) -> Result<()> {
        let payload = body.to_string();
        self.send(kind, payload.as_bytes()).await
    }

    /// Sends one frame; the agent's own refusal when it sent one and went.
    async fn send(&mut self, kind: u8, payload: &[u8]) -> Result<()> {
        let sent = tokio::time::timeout(
            FILE_IDLE_TIMEOUT,
            wire::write_frame(&mut self.writer, kind, payload),
        )
        .await;
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.refused_or(e.to_string()).await),
            Err(_) => Err(self.unreachable("the agent took nothing for 120 s")),
        }
    }

    async fn refused_or(&mut self, message: String) -> Error {
        match tokio::time::timeout(Duration::from_secs(1), wire::read_frame(&mut self.reader)).await
        {
            Ok(Ok(Some(frame))) if frame.kind == kind::ERROR => self.sandbox.refusal(&frame),
            _ => self.unreachable(message),
        }
    }

    /// The next frame, which must be one of `expected` (an error frame is
    /// the agent's refusal).
    async fn answer(&mut self, expected: &[u8]) -> Result<Frame> {
        let read =
            tokio::time::timeout(FILE_IDLE_TIMEOUT, wire::read_frame(&mut self.reader)).await;
        let frame = match read {
            Ok(Ok(Some(frame))) => frame,
            Ok(Ok(None)) => return Err(self.unreachable("the agent closed the connection")),
            Ok(Err(e)) => return Err(self.unreachable(e.to_string())),
            Err(_) => return Err(self.unreachable("no answer within 120 s")),
        };
        if frame.kind == kind::ERROR {
            return Err(self.sandbox.refusal(&frame));
        }
        if !expected.contains(&frame.kind) {
            return Err(self.bad_answer(format!("frame kind {}", frame.kind)));
        }
        Ok(frame)
    }
}

/// Bytes coming from the agent: a file's (part) or a tar stream.
#[derive(Debug)]
pub struct AgentDownload {
    connection: Connection,
    /// A file's part: how many bytes it must be.
    expected: Option<u64>,
    received: u64,
    /// A frame read ahead (a tar download's first).
    pending: Option<Frame>,
    done: Option<Value>,
}

impl AgentDownload {
    /// The next bytes (at most [`DATA_BYTES_MAX`]), or `None` once all
    /// came. An error ends the download: the agent's refusal (the file
    /// changed, the tree could not be read) or its going away.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>> {
        if self.done.is_some() {
            return Ok(None);
        }
        let frame = match self.pending.take() {
            Some(frame) => frame,
            None => self.connection.answer(&[kind::DATA, kind::DONE]).await?,
        };
        if frame.kind == kind::DONE {
            let value = self.connection.json(&frame)?;
            if let Some(expected) = self.expected
                && expected != self.received
            {
                return Err(self.connection.bad_answer(format!(
                    "{} bytes came of the {expected} announced",
                    self.received
                )));
            }
            self.done = Some(value);
            return Ok(None);
        }
        if frame.payload.len() > DATA_BYTES_MAX {
            return Err(self.connection.bad_answer("a data frame past its bound"));
        }
        self.received += frame.payload.len() as u64;
        if let Some(expected) = self.expected
            && self.received > expected
        {
            return Err(self
                .connection
                .bad_answer(format!("more than the {expected} bytes announced")));
        }
        Ok(Some(frame.payload))
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// A tar download's summary, once [`AgentDownload::next_chunk`] said
    /// it is complete.
    pub fn tar_summary(&self) -> Option<TarSummary> {
        self.done.as_ref().map(TarSummary::parse)
    }
}

/// An upload's connection.
#[derive(Debug)]
struct Upload {
    connection: Connection,
}

impl Upload {
    async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        for chunk in bytes.chunks(DATA_BYTES_MAX) {
            self.connection.send(kind::DATA, chunk).await?;
        }
        Ok(())
    }

    async fn finish(mut self) -> Result<Value> {
        self.connection.send(kind::DATA_END, b"").await?;
        let done = self.connection.answer(&[kind::DONE]).await?;
        self.connection.json(&done)
    }
}

/// A file being written in the sandbox. Dropped before
/// [`FileWriter::finish`], the upload is abandoned: the agent removes what
/// it wrote, and the file keeps its old content (or stays absent).
#[derive(Debug)]
pub struct FileWriter {
    upload: Upload,
}

impl FileWriter {
    /// Sends `bytes` on; waits while the agent writes what came before
    /// (back-pressure). A refusal comes as the agent's error code (for
    /// example `insufficient_storage`).
    pub async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.upload.write(bytes).await
    }

    /// Ends the upload: once the agent fsynced the file and renamed it
    /// into place, its size.
    pub async fn finish(self) -> Result<u64> {
        let done = self.upload.finish().await?;
        Ok(done["size"].as_u64().unwrap_or(0))
    }
}

/// A tar stream being unpacked in the sandbox.
#[derive(Debug)]
pub struct TarWriter {
    upload: Upload,
}

impl TarWriter {
    /// Sends the stream's next bytes on (back-pressure as for files).
    pub async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.upload.write(bytes).await
    }

    /// Ends the stream: what was unpacked.
    pub async fn finish(self) -> Result<TarSummary> {
        let done = self.upload.finish().await?;
        Ok(TarSummary::parse(&done))
    }
}
