//! `roost files put|get|ls|rm|mv|mkdir`: a running sandbox's files, moved
//! and changed by its own agent through the API (`/v1/sandboxes/{id}/files`).
//! Files stream both ways at the pace of the slower end, never held whole;
//! a directory goes as a tar stream (built and unpacked here with the
//! `tar` crate, on a blocking thread fed through a bounded channel).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use api::client::{Client, FileDownload, FileRange};
use api::files::{FileList, FileType, MkdirRequest, MoveRequest, TarSummary};
use clap::Subcommand;
use serde_json::json;
use store::progress::Progress;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::control::runtime;
use crate::output::{Bar, human_bytes, print_json, print_record, print_table};
use crate::sandbox::OrgTarget;

/// Bytes per chunk read from a local file or handed to a tar stream.
const CHUNK_BYTES: usize = 256 * 1024;
/// Chunks in flight between a tar thread and the request (back-pressure:
/// the thread blocks once this many wait).
const CHUNKS_QUEUED: usize = 8;
/// How much of a download is gathered before one write to disk.
const WRITE_BUFFER_BYTES: usize = 1 << 20;
/// The suffix of a download in progress, beside its destination.
const PART_SUFFIX: &str = ".roost-part";

#[derive(Subcommand)]
pub enum FilesCommand {
    /// Upload a local file (or `-`: stdin) to a path in the sandbox, or a
    /// local directory under a directory in the sandbox (as a tar stream).
    #[command(after_help = "\
A file is in place under REMOTE only once whole (the old content, if any,
stays until then); a REMOTE ending in `/` names a directory to put LOCAL's
file name in. A directory is unpacked under REMOTE (made where missing):
its files, directories and symlinks (as links), modes without setuid,
setgid and sticky.

Examples:
  roost files put sbx_0123 ./data.csv /workspace/data.csv
  roost files put sbx_0123 ./src /workspace/src
  tar c . | roost files put sbx_0123 - /workspace/snapshot.tar")]
    Put {
        /// The sandbox (it must be running).
        sandbox_id: String,
        /// A local file, a local directory, or `-` for stdin.
        local: PathBuf,
        /// The path in the sandbox (absolute, or relative to /workspace).
        remote: String,
        /// The file's permission bits, octal (default 0644).
        #[arg(long, value_name = "MODE")]
        mode: Option<String>,
        /// Make REMOTE's missing parent directories.
        #[arg(short = 'p', long)]
        parents: bool,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Download a file (or a directory, as a tar stream) from the sandbox
    /// to a local path or `-` (stdout).
    #[command(after_help = "\
LOCAL defaults to REMOTE's file name in the current directory; an existing
local directory receives REMOTE's file name in it. A file is written beside
LOCAL as LOCAL.roost-part and renamed to LOCAL once whole, with the
sandbox's permission bits; --resume continues such a part from where it
stopped. A directory is unpacked into LOCAL (made where missing); nothing
of it lands outside LOCAL.

Examples:
  roost files get sbx_0123 /workspace/out/report.pdf
  roost files get sbx_0123 /var/log/app.log - --range -4096
  roost files get sbx_0123 /workspace/src ./src-copy")]
    Get {
        /// The sandbox (it must be running).
        sandbox_id: String,
        /// The path in the sandbox (absolute, or relative to /workspace).
        remote: String,
        /// A local path, or `-` for stdout.
        local: Option<PathBuf>,
        /// Only these bytes: `A-B` (inclusive), `A-` or `-N` (the last N).
        #[arg(long, value_name = "RANGE", value_parser = FileRange::parse, conflicts_with = "resume")]
        range: Option<FileRange>,
        /// Continue LOCAL.roost-part, left by an interrupted download.
        #[arg(long)]
        resume: bool,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// List a directory in the sandbox (or show a file).
    Ls {
        /// The sandbox (it must be running).
        sandbox_id: String,
        /// The path in the sandbox (absolute, or relative to /workspace;
        /// default /workspace).
        #[arg(default_value = ".", hide_default_value = true)]
        path: String,
        /// Levels to descend (1 to 16).
        #[arg(long, default_value_t = 1, value_name = "N")]
        depth: u32,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Remove a file, a symlink or a directory in the sandbox.
    Rm {
        /// The sandbox (it must be running).
        sandbox_id: String,
        /// The path in the sandbox (absolute, or relative to /workspace).
        path: String,
        /// Remove a non-empty directory and everything in it.
        #[arg(short = 'r', long)]
        recursive: bool,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Rename a file or directory within the sandbox.
    Mv {
        /// The sandbox (it must be running).
        sandbox_id: String,
        /// The path to rename (absolute, or relative to /workspace).
        from: String,
        /// Its new path.
        to: String,
        /// Replace TO if it exists.
        #[arg(long)]
        overwrite: bool,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Make a directory in the sandbox.
    Mkdir {
        /// The sandbox (it must be running).
        sandbox_id: String,
        /// The directory to make (absolute, or relative to /workspace).
        path: String,
        /// Make missing parents too (an existing directory is then fine).
        #[arg(short = 'p', long)]
        parents: bool,
        /// Permission bits, octal (default 0755).
        #[arg(long, value_name = "MODE")]
        mode: Option<String>,
        #[command(flatten)]
        target: OrgTarget,
    },
}

pub fn run(command: FilesCommand) -> Result<ExitCode> {
    runtime()?.block_on(files(command))?;
    Ok(ExitCode::SUCCESS)
}

async fn files(command: FilesCommand) -> Result<()> {
    match command {
        FilesCommand::Put {
            sandbox_id,
            local,
            remote,
            mode,
            parents,
            target,
        } => {
            let client = target.client()?;
            put(
                &client,
                &sandbox_id,
                &local,
                &remote,
                mode.as_deref(),
                parents,
                target.json,
            )
            .await
        }
        FilesCommand::Get {
            sandbox_id,
            remote,
            local,
            range,
            resume,
            target,
        } => {
            let client = target.client()?;
            let request = GetRequest {
                sandbox_id: &sandbox_id,
                remote: &remote,
                local,
                range,
                resume,
                json: target.json,
            };
            get(&client, request).await
        }
        FilesCommand::Ls {
            sandbox_id,
            path,
            depth,
            target,
        } => {
            let list = target
                .client()?
                .list_files(&sandbox_id, &path, depth)
                .await
                .with_context(|| format!("cannot list {path} in sandbox {sandbox_id}"))?;
            if target.json {
                print_record(&list)?;
            } else {
                print_listing(&list);
            }
            Ok(())
        }
        FilesCommand::Rm {
            sandbox_id,
            path,
            recursive,
            target,
        } => {
            let removed = target
                .client()?
                .remove_file(&sandbox_id, &path, recursive)
                .await
                .with_context(|| format!("cannot remove {path} in sandbox {sandbox_id}"))?;
            if target.json {
                print_record(&removed)?;
            }
            Ok(())
        }
        FilesCommand::Mv {
            sandbox_id,
            from,
            to,
            overwrite,
            target,
        } => {
            let request = MoveRequest {
                from: from.clone(),
                to: to.clone(),
                overwrite,
            };
            let moved = target
                .client()?
                .move_file(&sandbox_id, &request)
                .await
                .with_context(|| format!("cannot move {from} to {to} in sandbox {sandbox_id}"))?;
            if target.json {
                print_record(&moved)?;
            }
            Ok(())
        }
        FilesCommand::Mkdir {
            sandbox_id,
            path,
            parents,
            mode,
            target,
        } => {
            let request = MkdirRequest {
                path: path.clone(),
                parents,
                mode,
            };
            let made = target
                .client()?
                .make_dir(&sandbox_id, &request)
                .await
                .with_context(|| format!("cannot make {path} in sandbox {sandbox_id}"))?;
            if target.json {
                print_record(&made)?;
            }
            Ok(())
        }
    }
}

fn print_listing(list: &FileList) {
    let rows: Vec<Vec<String>> = list
        .entries
        .iter()
        .map(|entry| {
            let name = match &entry.link_target {
                Some(target) => format!("{} -> {target}", entry.path),
                None => entry.path.clone(),
            };
            let size = match entry.kind {
                FileType::Directory => "-".to_owned(),
                _ => human_bytes(entry.size),
            };
            vec![
                entry.kind.as_str().to_owned(),
                entry.mode.clone(),
                size,
                entry.modified_at.clone(),
                name,
            ]
        })
        .collect();
    print_table(&["TYPE", "MODE", "SIZE", "MODIFIED", "PATH"], &rows);
    if list.truncated {
        println!(
            "(truncated at {} entries: list a deeper path, or with a smaller --depth)",
            list.entries.len()
        );
    }
}

/// A local file (or stdin) as a request body, counted on `bar`.
fn file_body<R>(reader: R, bar: Bar) -> reqwest::Body
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    let chunks = futures::stream::unfold((reader, bar), |(mut reader, bar)| async move {
        let mut buffer = vec![0u8; CHUNK_BYTES];
        match tokio::io::AsyncReadExt::read(&mut reader, &mut buffer).await {
            Ok(0) => {
                bar.finish();
                None
            }
            Ok(n) => {
                buffer.truncate(n);
                bar.advance(n as u64);
                Some((Ok::<_, std::io::Error>(buffer), (reader, bar)))
            }
            Err(err) => Some((Err(err), (reader, bar))),
        }
    });
    reqwest::Body::wrap_stream(chunks)
}

async fn put(
    client: &Client,
    sandbox_id: &str,
    local: &Path,
    remote: &str,
    mode: Option<&str>,
    parents: bool,
    json: bool,
) -> Result<()> {
    let shown = local.display();
    if local == Path::new("-") {
        let body = file_body(tokio::io::stdin(), Bar::new(true));
        return put_file(
            client, sandbox_id, "stdin", remote, body, mode, parents, json,
        )
        .await;
    }
    let metadata = std::fs::metadata(local).with_context(|| format!("cannot read {shown}"))?;
    if metadata.is_dir() {
        if mode.is_some() {
            bail!("--mode is for a file; a directory's entries keep their own modes");
        }
        return put_directory(client, sandbox_id, local, remote, json).await;
    }
    let remote = match (remote.ends_with('/'), local.file_name()) {
        (true, Some(name)) => format!("{remote}{}", name.to_string_lossy()),
        _ => remote.to_owned(),
    };
    let file = tokio::fs::File::open(local)
        .await
        .with_context(|| format!("cannot read {shown}"))?;
    let bar = Bar::new(json);
    bar.phase("upload", Some(metadata.len()));
    let body = file_body(file, bar);
    put_file(
        client,
        sandbox_id,
        &shown.to_string(),
        &remote,
        body,
        mode,
        parents,
        json,
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn put_file(
    client: &Client,
    sandbox_id: &str,
    shown: &str,
    remote: &str,
    body: reqwest::Body,
    mode: Option<&str>,
    parents: bool,
    json: bool,
) -> Result<()> {
    let (created, written) = client
        .put_file(sandbox_id, remote, body, mode, parents)
        .await
        .with_context(|| format!("cannot write {remote} in sandbox {sandbox_id}"))?;
    if json {
        print_record(&written)?;
    } else {
        let how = if created { "made" } else { "replaced" };
        println!(
            "{shown} -> {sandbox_id}:{} ({}, {how})",
            written.path,
            human_bytes(written.size)
        );
    }
    Ok(())
}

/// A `Write` whose bytes go to an async request body in chunks of
/// [`CHUNK_BYTES`], blocking while [`CHUNKS_QUEUED`] wait (back-pressure
/// from the network to the thread building the tar).
struct ChannelWriter {
    sender: mpsc::Sender<std::io::Result<Vec<u8>>>,
    buffer: Vec<u8>,
}

impl ChannelWriter {
    fn send_buffer(&mut self) -> std::io::Result<()> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buffer, Vec::with_capacity(CHUNK_BYTES));
        self.sender
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the upload ended"))
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(bytes);
        if self.buffer.len() >= CHUNK_BYTES {
            self.send_buffer()?;
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send_buffer()
    }
}

async fn put_directory(
    client: &Client,
    sandbox_id: &str,
    local: &Path,
    remote: &str,
    json: bool,
) -> Result<()> {
    let (sender, receiver) = mpsc::channel(CHUNKS_QUEUED);
    let root = local.to_path_buf();
    let packing = tokio::task::spawn_blocking(move || {
        let mut writer = ChannelWriter {
            sender,
            buffer: Vec::with_capacity(CHUNK_BYTES),
        };
        let errors = writer.sender.clone();
        let mut builder = tar::Builder::new(&mut writer);
        builder.follow_symlinks(false);
        let packed = builder
            .append_dir_all(".", &root)
            .and_then(|()| builder.finish());
        drop(builder);
        let packed = packed.and_then(|()| writer.flush());
        if let Err(err) = &packed {
            // The body ends in an error: the request is cut, never taken
            // for a whole archive.
            let _ = errors.blocking_send(Err(std::io::Error::new(err.kind(), err.to_string())));
        }
        packed
    });
    let bar = Bar::new(json);
    bar.phase("upload", None);
    let chunks = futures::stream::unfold((receiver, bar), |(mut receiver, bar)| async move {
        match receiver.recv().await {
            Some(chunk) => {
                if let Ok(chunk) = &chunk {
                    bar.advance(chunk.len() as u64);
                }
                Some((chunk, (receiver, bar)))
            }
            None => {
                bar.finish();
                None
            }
        }
    });
    let sent = client
        .put_tar(sandbox_id, remote, reqwest::Body::wrap_stream(chunks))
        .await;
    // A local failure explains a cut request better than the server's
    // answer to it; the upload ending first (the server refused it) is
    // the server's to explain.
    let packed = packing.await.context("the tar thread failed")?;
    match packed {
        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe || sent.is_ok() => {
            return Err(err).with_context(|| format!("cannot read {}", local.display()));
        }
        _ => {}
    }
    let summary =
        sent.with_context(|| format!("cannot unpack into {remote} in sandbox {sandbox_id}"))?;
    if json {
        print_record(&summary)?;
    } else {
        println!(
            "{} -> {sandbox_id}:{remote} ({} files, {} directories, {} symlinks, {}{})",
            local.display(),
            summary.files,
            summary.directories,
            summary.symlinks,
            human_bytes(summary.bytes),
            skipped(&summary),
        );
    }
    Ok(())
}

fn skipped(summary: &TarSummary) -> String {
    if summary.skipped == 0 {
        String::new()
    } else {
        format!(", {} special files skipped", summary.skipped)
    }
}

struct GetRequest<'a> {
    sandbox_id: &'a str,
    remote: &'a str,
    local: Option<PathBuf>,
    range: Option<FileRange>,
    resume: bool,
    json: bool,
}

/// REMOTE's last component (for a default local name).
fn remote_name(remote: &str) -> Result<String> {
    match remote.trim_end_matches('/').rsplit('/').next() {
        Some(name) if !name.is_empty() && name != "." && name != ".." => Ok(name.to_owned()),
        _ => bail!("{remote:?} has no file name: name the local destination"),
    }
}

async fn get(client: &Client, request: GetRequest<'_>) -> Result<()> {
    let GetRequest {
        sandbox_id, remote, ..
    } = request;
    let to_stdout = request.local.as_deref() == Some(Path::new("-"));
    if to_stdout && request.json {
        bail!("--json and `-` both want stdout: name a local file instead");
    }
    let local = match &request.local {
        Some(local) if to_stdout => local.clone(),
        Some(local) if local.is_dir() => local.join(remote_name(remote)?),
        Some(local) => local.clone(),
        None => PathBuf::from(remote_name(remote)?),
    };
    let part = part_path(&local);
    let range = match (request.resume, request.range) {
        (true, _) => match std::fs::metadata(&part) {
            Ok(metadata) if metadata.len() > 0 => Some(FileRange::From(metadata.len())),
            _ => None,
        },
        (false, range) => range,
    };
    let download = match client.get_file(sandbox_id, remote, range).await {
        Ok(download) => download,
        // A directory: as a tar stream (unless a tar is refused too, when
        // the first refusal says what is wrong).
        Err(first) if first.code() == Some(api::ErrorCode::InvalidState) => {
            if to_stdout || range.is_some() {
                return Err(first)
                    .with_context(|| format!("cannot read {remote} in sandbox {sandbox_id}"));
            }
            return match client.get_tar(sandbox_id, remote).await {
                Ok(tar) => get_directory(tar, &request, &local).await,
                Err(_) => Err(first)
                    .with_context(|| format!("cannot read {remote} in sandbox {sandbox_id}")),
            };
        }
        Err(err) if request.resume && err.code() == Some(api::ErrorCode::RangeNotSatisfiable) => {
            return finish_resumed(client, &request, &part, &local).await;
        }
        Err(err) => {
            return Err(err)
                .with_context(|| format!("cannot read {remote} in sandbox {sandbox_id}"));
        }
    };
    if to_stdout {
        let mut stdout = tokio::io::stdout();
        let mut download = download;
        while let Some(chunk) = next(&mut download, &request).await? {
            stdout
                .write_all(&chunk)
                .await
                .context("cannot write to stdout")?;
        }
        stdout.flush().await.context("cannot write to stdout")?;
        return Ok(());
    }
    get_file(download, &request, &part, &local).await
}

/// The next chunk of a download, its error naming the path.
async fn next(
    download: &mut FileDownload,
    request: &GetRequest<'_>,
) -> Result<Option<bytes::Bytes>> {
    download.next_chunk().await.with_context(|| {
        format!(
            "cannot read {} in sandbox {}",
            request.remote, request.sandbox_id
        )
    })
}

/// Where a download is written until whole: `LOCAL.roost-part`.
fn part_path(local: &Path) -> PathBuf {
    let mut name = local.as_os_str().to_owned();
    name.push(PART_SUFFIX);
    PathBuf::from(name)
}

async fn get_file(
    mut download: FileDownload,
    request: &GetRequest<'_>,
    part: &Path,
    local: &Path,
) -> Result<()> {
    let resumed = request.resume && download.offset > 0;
    let file = if resumed {
        std::fs::OpenOptions::new().append(true).open(part)
    } else {
        std::fs::File::create(part)
    }
    .with_context(|| format!("cannot write {}", part.display()))?;
    if resumed {
        let have = file
            .metadata()
            .with_context(|| format!("cannot read {}", part.display()))?
            .len();
        if have != download.offset {
            bail!(
                "{} changed while resuming ({have} bytes, the download starts at {})",
                part.display(),
                download.offset
            );
        }
    }
    // The disk's side on a blocking thread, fed through a bounded channel:
    // writes in large pieces, never a thread hand-off per network chunk.
    let (sender, mut receiver) = mpsc::channel::<bytes::Bytes>(CHUNKS_QUEUED);
    // The disk writes while the bytes come (write-behind), so the fsync at
    // the end has little left.
    let offset = download.offset;
    let writing = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        let behind = oci::host::WriteBehind::new(file, if resumed { offset } else { 0 });
        let mut out = std::io::BufWriter::with_capacity(WRITE_BUFFER_BYTES, behind);
        while let Some(chunk) = receiver.blocking_recv() {
            out.write_all(&chunk)?;
        }
        out.into_inner()
            .map_err(|e| e.into_error())?
            .into_inner()
            .sync_all()
    });
    let bar = Bar::new(request.json);
    bar.phase("download", download.length);
    let fed: Result<()> = async {
        while let Some(chunk) = next(&mut download, request).await? {
            bar.advance(chunk.len() as u64);
            if sender.send(chunk).await.is_err() {
                // The writer stopped: its error says why.
                break;
            }
        }
        Ok(())
    }
    .await;
    bar.finish();
    drop(sender);
    let written = writing.await.context("the writing thread failed")?;
    fed?;
    written.with_context(|| format!("cannot write {}", part.display()))?;
    // A whole file gets the sandbox's permission bits (never setuid,
    // setgid or sticky); a range is only bytes.
    if request.range.is_none()
        && let Some(mode) = download
            .mode
            .as_deref()
            .and_then(|m| u32::from_str_radix(m, 8).ok())
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(part, std::fs::Permissions::from_mode(mode & 0o777))
            .with_context(|| format!("cannot set the mode of {}", part.display()))?;
    }
    std::fs::rename(part, local).with_context(|| format!("cannot write {}", local.display()))?;
    let bytes = download.offset + download.received();
    if request.json {
        print_json(&json!({
            "sandbox_id": request.sandbox_id,
            "path": request.remote,
            "local": local.display().to_string(),
            "type": "file",
            "bytes": bytes,
            "size": download.size,
            "mode": download.mode,
        }));
    } else {
        println!(
            "{}:{} -> {} ({})",
            request.sandbox_id,
            request.remote,
            local.display(),
            human_bytes(bytes)
        );
    }
    Ok(())
}

/// A resumed download whose part already holds the whole file (the
/// server found nothing past it): checked against the file's size, then
/// put in place.
async fn finish_resumed(
    client: &Client,
    request: &GetRequest<'_>,
    part: &Path,
    local: &Path,
) -> Result<()> {
    let listing = client
        .list_files(request.sandbox_id, request.remote, 1)
        .await
        .with_context(|| {
            format!(
                "cannot read {} in sandbox {}",
                request.remote, request.sandbox_id
            )
        })?;
    let have = std::fs::metadata(part)
        .with_context(|| format!("cannot read {}", part.display()))?
        .len();
    let size = listing.entries.first().map(|entry| entry.size);
    if size != Some(have) {
        bail!(
            "{} holds {have} bytes but {} now has {}: remove it and download again",
            part.display(),
            request.remote,
            size.map_or_else(|| "none".to_owned(), |s| format!("{s} bytes"))
        );
    }
    std::fs::rename(part, local).with_context(|| format!("cannot write {}", local.display()))?;
    if request.json {
        print_json(&json!({
            "sandbox_id": request.sandbox_id,
            "path": request.remote,
            "local": local.display().to_string(),
            "type": "file",
            "bytes": have,
            "size": have,
        }));
    }
    Ok(())
}

/// A `Read` over chunks an async download hands to a blocking thread.
struct ChannelReader {
    receiver: mpsc::Receiver<std::io::Result<bytes::Bytes>>,
    current: bytes::Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.receiver.blocking_recv() {
                Some(chunk) => self.current = chunk?,
                None => return Ok(0),
            }
        }
        let n = buffer.len().min(self.current.len());
        buffer[..n].copy_from_slice(&self.current[..n]);
        self.current = self.current.slice(n..);
        Ok(n)
    }
}

/// Unpacks `archive` under `destination` as the `tar` crate does (no entry
/// outside it, whatever its paths and symlinks), counting what it holds;
/// directories last, so a read-only one is filled first.
fn unpack(archive: impl Read, destination: &Path) -> std::io::Result<TarSummary> {
    let mut archive = tar::Archive::new(archive);
    let mut summary = TarSummary::default();
    let mut directories = Vec::new();
    for entry in archive.entries()? {
        let mut entry = entry?;
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            summary.directories += 1;
            directories.push(entry);
            continue;
        }
        if kind.is_file() || kind.is_hard_link() {
            summary.files += 1;
            summary.bytes += entry.size();
        } else if kind.is_symlink() {
            summary.symlinks += 1;
        } else {
            summary.skipped += 1;
            continue;
        }
        entry.unpack_in(destination)?;
    }
    directories.reverse();
    for mut directory in directories {
        directory.unpack_in(destination)?;
    }
    Ok(summary)
}

async fn get_directory(
    mut download: FileDownload,
    request: &GetRequest<'_>,
    local: &Path,
) -> Result<()> {
    std::fs::create_dir_all(local).with_context(|| format!("cannot make {}", local.display()))?;
    let (sender, receiver) = mpsc::channel(CHUNKS_QUEUED);
    let destination = local.to_path_buf();
    let unpacking = tokio::task::spawn_blocking(move || {
        let reader = ChannelReader {
            receiver,
            current: bytes::Bytes::new(),
        };
        unpack(reader, &destination)
    });
    let bar = Bar::new(request.json);
    bar.phase("download", None);
    let fed: Result<()> = async {
        while let Some(chunk) = next(&mut download, request).await? {
            bar.advance(chunk.len() as u64);
            if sender.send(Ok(chunk)).await.is_err() {
                // The unpacking stopped: its error says why.
                break;
            }
        }
        Ok(())
    }
    .await;
    bar.finish();
    if let Err(err) = &fed {
        let _ = sender
            .send(Err(std::io::Error::other(format!("{err:#}"))))
            .await;
    }
    drop(sender);
    let unpacked = unpacking.await.context("the tar thread failed")?;
    fed?;
    let summary = unpacked.with_context(|| format!("cannot unpack into {}", local.display()))?;
    if request.json {
        print_json(&json!({
            "sandbox_id": request.sandbox_id,
            "path": request.remote,
            "local": local.display().to_string(),
            "type": "directory",
            "files": summary.files,
            "directories": summary.directories,
            "symlinks": summary.symlinks,
            "bytes": summary.bytes,
            "skipped": summary.skipped,
        }));
    } else {
        println!(
            "{}:{} -> {} ({} files, {} directories, {} symlinks, {}{})",
            request.sandbox_id,
            request.remote,
            local.display(),
            summary.files,
            summary.directories,
            summary.symlinks,
            human_bytes(summary.bytes),
            skipped(&summary),
        );
    }
    Ok(())
}
