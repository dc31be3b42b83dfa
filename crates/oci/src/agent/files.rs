//! The agent's file operations, inside the sandbox (see [`super`]): read,
//! write, list, remove, move, make directories, and a directory as a tar
//! stream either way.
//!
//! They run in the init, so in the sandbox's own mount namespace and with
//! its privileges: the sandbox's `/` is the root, and a symlink the sandbox
//! made can lead only to the sandbox's own files (a write through one to
//! its read-only `/etc` is refused, one to a host path lands in the
//! sandbox's own tree or nowhere). Paths are absolute or relative to
//! `/workspace`; an empty one, one over [`PATH_BYTES_MAX`] bytes, one with
//! a NUL byte or a `..` component is refused (`bad_request`) before
//! anything is touched.
//!
//! Every blocking filesystem call runs on tokio's blocking pool
//! (`spawn_blocking`), never on the init's one thread, which keeps
//! serving commands. Bytes move between the connection and that worker
//! through a channel of a few (`CHUNKS_QUEUED`) chunks of at most
//! [`DATA_BYTES_MAX`]: an upload is read from the socket only as fast as
//! it is written to disk, a download read from disk only as fast as the
//! runner takes it.
//!
//! An upload is written to a file of no name in its target's directory
//! (`O_TMPFILE`), fsynced, given its mode, linked in as
//! `.roost-upload-RANDOM` and at once renamed over the target. So the
//! target holds its old content or the new, never a part, and an agent
//! killed mid-upload (its sandbox stopped) leaves nothing: a file of no
//! name goes with its last descriptor. Where the filesystem has no
//! `O_TMPFILE` (some network filesystems), the file has that name from
//! the start (`O_EXCL`), and any failure, or the runner going away before
//! `DATA_END`, removes it; only the agent's own death leaves it then.
//!
//! A tar stream is unpacked without following any symlink in the tree:
//! each directory on an entry's way is opened one component at a time
//! with `O_NOFOLLOW` from the target directory's descriptor, so an entry
//! never lands outside it, whatever the tar or the tree hold. Entries with
//! an absolute path or a `..` component, or whose way goes through a
//! symlink, refuse the whole stream (`bad_request`); setuid, setgid and
//! sticky bits are cleared; device nodes, fifos and other special entries
//! are skipped and counted. A refused or broken stream leaves what was
//! unpacked before it in place (never a partly written file).

use std::collections::VecDeque;
use std::ffi::{CStr, OsStr, OsString};
use std::fs::{DirBuilder, File, Metadata, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, CWD, Dir, FileType, Mode, OFlags, RenameFlags, Timestamps};
use rustix::io::Errno;
use serde_json::{Value, json};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;

use super::wire::{self, FRAME_BYTES_MAX, Frame, kind};
use crate::spec::WORKSPACE_PATH;

/// The longest path a request may name.
pub const PATH_BYTES_MAX: usize = 4096;
/// The most bytes one `DATA` frame carries (either way).
pub const DATA_BYTES_MAX: usize = 64 * 1024;
/// The deepest listing.
pub const LIST_DEPTH_MAX: u64 = 16;
/// The most entries a listing answers; past them it says `truncated`.
pub const LIST_ENTRIES_MAX: usize = 10_000;
/// The most JSON a listing's entries take; past it the listing says
/// `truncated`, as past [`LIST_ENTRIES_MAX`]. Real entries are about a
/// hundred bytes (10,000 of them about 1 MiB), but a sandbox can name its
/// files with paths of 4 KiB and control characters JSON escapes six-fold:
/// without a bound of its own a listing could be hundreds of MiB for the
/// runner and the server to hold.
pub const LIST_JSON_BYTES_MAX: usize = 8 * 1024 * 1024;
/// The deepest directory a tar download descends into (one descriptor per
/// level is open while it walks).
pub const TAR_DEPTH_MAX: usize = 128;
/// The prefix of an upload's temporary file, beside its target.
pub const UPLOAD_PREFIX: &str = ".roost-upload-";
/// Chunks in flight between a connection and its blocking worker.
const CHUNKS_QUEUED: usize = 4;
/// A `LISTING` frame's entries stop short of this much JSON.
const LISTING_FRAME_BYTES: usize = FRAME_BYTES_MAX / 2;
/// The longest path an error message shows.
const SHOWN_CHARS_MAX: usize = 200;

/// A refusal: a stable code and a one-line message, sent as an error frame.
#[derive(Debug)]
struct Failure {
    code: &'static str,
    message: String,
}

fn fail(code: &'static str, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

/// A malformed request, or the connection failing (then nobody reads the
/// error frame anyway).
impl From<io::Error> for Failure {
    fn from(err: io::Error) -> Failure {
        fail("bad_request", err.to_string())
    }
}

/// The stable code of a failed filesystem call.
fn errno_code(errno: Errno) -> &'static str {
    match errno {
        Errno::NOENT => "not_found",
        Errno::ISDIR => "is_a_directory",
        Errno::NOTDIR => "not_a_directory",
        Errno::ACCESS | Errno::PERM | Errno::ROFS | Errno::TXTBSY => "permission_denied",
        Errno::NOSPC | Errno::DQUOT | Errno::FBIG => "insufficient_storage",
        Errno::EXIST => "already_exists",
        Errno::NOTEMPTY => "directory_not_empty",
        Errno::XDEV => "cross_device",
        Errno::NAMETOOLONG | Errno::LOOP | Errno::INVAL => "bad_request",
        _ => "io_error",
    }
}

/// `what` failed on `path`: the code of its errno, the path in the message.
fn os_failure(err: io::Error, what: &str, path: &Path) -> Failure {
    let code = match err.raw_os_error() {
        Some(raw) => errno_code(Errno::from_raw_os_error(raw)),
        None => "io_error",
    };
    fail(code, format!("cannot {what} {}: {err}", shown(path)))
}

/// A path for a message: lossy, and cut short.
fn shown(path: &Path) -> String {
    let text = path.to_string_lossy();
    if text.chars().count() <= SHOWN_CHARS_MAX {
        format!("{text:?}")
    } else {
        let head: String = text.chars().take(SHOWN_CHARS_MAX).collect();
        format!("{head:?}…")
    }
}

/// A request's path in the sandbox: absolute, or relative to
/// `/workspace`; `.` and repeated slashes dropped. Refused before anything
/// is touched: empty, longer than [`PATH_BYTES_MAX`], a NUL byte, a `..`
/// component.
pub fn sandbox_path(raw: &str) -> Result<PathBuf, String> {
    if raw.is_empty() {
        return Err("the path is empty".to_owned());
    }
    if raw.len() > PATH_BYTES_MAX {
        return Err(format!(
            "the path is {} bytes, past the bound of {PATH_BYTES_MAX}",
            raw.len()
        ));
    }
    if raw.contains('\0') {
        return Err("the path holds a NUL byte".to_owned());
    }
    if raw.split('/').any(|component| component == "..") {
        return Err(format!(
            "the path {} has a `..` component",
            shown(Path::new(raw))
        ));
    }
    let mut path = PathBuf::from(if raw.starts_with('/') {
        "/"
    } else {
        WORKSPACE_PATH
    });
    for component in raw.split('/') {
        if !component.is_empty() && component != "." {
            path.push(component);
        }
    }
    Ok(path)
}

fn path_field(request: &Value, name: &str) -> Result<PathBuf, Failure> {
    sandbox_path(wire::text(request, name)?).map_err(|message| fail("bad_request", message))
}

/// `request[name]` as a flag (absent: false).
fn flag(request: &Value, name: &str) -> Result<bool, Failure> {
    match &request[name] {
        Value::Null => Ok(false),
        Value::Bool(value) => Ok(*value),
        _ => Err(fail(
            "bad_request",
            format!("field {name:?} is not a boolean"),
        )),
    }
}

/// `request[name]` as an unsigned integer, if present.
fn optional_number(request: &Value, name: &str) -> Result<Option<u64>, Failure> {
    match &request[name] {
        Value::Null => Ok(None),
        other => other.as_u64().map(Some).ok_or_else(|| {
            fail(
                "bad_request",
                format!("field {name:?} is not an unsigned integer"),
            )
        }),
    }
}

/// A mode as asked: permission bits only (never setuid, setgid, sticky).
fn permission_bits(mode: u64) -> u32 {
    (mode & 0o777) as u32
}

/// Runs `work` on the blocking pool.
async fn blocking<T, F>(work: F) -> Result<T, Failure>
where
    F: FnOnce() -> Result<T, Failure> + Send + 'static,
    T: Send + 'static,
{
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        Err(e) => Err(fail("io_error", format!("the file operation failed: {e}"))),
    }
}

/// Serves a connection whose first frame is a file request; every refusal
/// is an error frame.
pub(super) async fn serve(first: &Frame, reader: OwnedReadHalf, writer: &mut OwnedWriteHalf) {
    let result = match first.json() {
        Err(e) => Err(Failure::from(e)),
        Ok(request) => match first.kind {
            kind::FILE_READ => read(&request, writer).await,
            kind::FILE_WRITE => write(&request, reader, writer).await,
            kind::FILE_LIST => list(&request, writer).await,
            kind::FILE_REMOVE => remove(&request, writer).await,
            kind::FILE_MOVE => rename(&request, writer).await,
            kind::FILE_MKDIR => mkdir(&request, writer).await,
            kind::TAR_READ => tar_read(&request, writer).await,
            kind::TAR_WRITE => tar_write(&request, reader, writer).await,
            other => Err(fail(
                "bad_request",
                format!("frame kind {other} is not a file request"),
            )),
        },
    };
    if let Err(failure) = result {
        let _ = wire::write_error(writer, failure.code, &failure.message).await;
    }
}

fn mtime_unix_ms(metadata: &Metadata) -> i64 {
    metadata
        .mtime()
        .saturating_mul(1000)
        .saturating_add(metadata.mtime_nsec() / 1_000_000)
}

fn type_name(metadata: &Metadata) -> &'static str {
    let file_type = metadata.file_type();
    if file_type.is_file() {
        "file"
    } else if file_type.is_dir() {
        "directory"
    } else if file_type.is_symlink() {
        "symlink"
    } else {
        "other"
    }
}

// ---------------------------------------------------------------- read

/// `FILE_READ {path, offset, length?}` → `FILE_INFO`, `DATA`…, `DONE {size}`.
async fn read(request: &Value, writer: &mut OwnedWriteHalf) -> Result<(), Failure> {
    let path = path_field(request, "path")?;
    let offset = wire::number(request, "offset")?;
    let length = optional_number(request, "length")?;
    let opened = path.clone();
    let (file, metadata) = blocking(move || open_regular(&opened)).await?;
    let size = metadata.len();
    if offset > size {
        return Err(fail(
            "offset_past_end",
            format!(
                "offset {offset} is past the end of {} ({size} bytes)",
                shown(&path)
            ),
        ));
    }
    let info = json!({
        "size": size,
        "mode": metadata.mode() & 0o7777,
        "mtime_unix_ms": mtime_unix_ms(&metadata),
        "type": "file",
    });
    wire::write_json(writer, kind::FILE_INFO, &info).await?;
    let wanted = (size - offset).min(length.unwrap_or(u64::MAX));
    let (sender, mut chunks) = mpsc::channel(CHUNKS_QUEUED);
    tokio::task::spawn_blocking(move || read_chunks(&file, &path, offset, wanted, &sender));
    let mut sent = 0u64;
    while let Some(chunk) = chunks.recv().await {
        let chunk = chunk?;
        wire::write_frame(writer, kind::DATA, &chunk).await?;
        sent += chunk.len() as u64;
    }
    wire::write_json(writer, kind::DONE, &json!({"size": sent})).await?;
    Ok(())
}

/// Opens a regular file to read (a fifo would block: `O_NONBLOCK`, then
/// refused with the other special files).
fn open_regular(path: &Path) -> Result<(File, Metadata), Failure> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(OFlags::NONBLOCK.bits() as i32)
        .open(path)
        .map_err(|e| os_failure(e, "open", path))?;
    let metadata = file.metadata().map_err(|e| os_failure(e, "stat", path))?;
    if metadata.is_dir() {
        return Err(fail(
            "is_a_directory",
            format!("{} is a directory", shown(path)),
        ));
    }
    if !metadata.is_file() {
        return Err(fail(
            "bad_request",
            format!("{} is not a regular file", shown(path)),
        ));
    }
    Ok((file, metadata))
}

/// Reads `wanted` bytes from `offset` in chunks into `sender`; stops when
/// the connection went away (the receiver is dropped).
fn read_chunks(
    file: &File,
    path: &Path,
    offset: u64,
    wanted: u64,
    sender: &mpsc::Sender<Result<Vec<u8>, Failure>>,
) {
    let end = offset + wanted;
    let mut at = offset;
    while at < end {
        let mut chunk = vec![0u8; (end - at).min(DATA_BYTES_MAX as u64) as usize];
        let read = match file.read_at(&mut chunk, at) {
            Ok(0) => Err(fail(
                "io_error",
                format!("{} shrank while it was read", shown(path)),
            )),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Err(os_failure(e, "read", path)),
        };
        match read {
            Ok(n) => {
                chunk.truncate(n);
                at += n as u64;
                if sender.blocking_send(Ok(chunk)).is_err() {
                    return;
                }
            }
            Err(failure) => {
                let _ = sender.blocking_send(Err(failure));
                return;
            }
        }
    }
}

// ---------------------------------------------------------------- uploads

/// What the connection hands an upload's worker.
enum Piece {
    Bytes(Vec<u8>),
    End,
}

/// How forwarding an upload's frames ended.
enum Forwarded {
    /// `DATA_END` came (and was handed on, if the worker still reads).
    Ended,
    /// The worker stopped taking bytes (it failed, or the tar ended).
    WorkerStopped,
    /// The runner went away before `DATA_END`.
    Gone,
    /// A frame that has no place in an upload.
    Refused(Failure),
}

/// Hands the runner's `DATA` frames to the worker, one at a time: the next
/// frame is read only once the channel has room (back-pressure).
async fn forward(reader: &mut OwnedReadHalf, sender: &mpsc::Sender<Piece>) -> Forwarded {
    loop {
        match wire::read_frame(reader).await {
            Ok(Some(frame)) if frame.kind == kind::DATA => {
                if sender.send(Piece::Bytes(frame.payload)).await.is_err() {
                    return Forwarded::WorkerStopped;
                }
            }
            Ok(Some(frame)) if frame.kind == kind::DATA_END => {
                // A worker that stopped already (a tar stream's end came
                // before the runner's) needs no `End`: the frame is taken
                // all the same, and there is nothing left to drain.
                let _ = sender.send(Piece::End).await;
                return Forwarded::Ended;
            }
            Ok(Some(frame)) => {
                return Forwarded::Refused(fail(
                    "bad_request",
                    format!("frame kind {} in an upload", frame.kind),
                ));
            }
            Ok(None) => return Forwarded::Gone,
            Err(e) => return Forwarded::Refused(e.into()),
        }
    }
}

/// Reads and drops frames up to `DATA_END` (what follows the end of a tar
/// stream); false if the runner went away first.
async fn drain_to_end(reader: &mut OwnedReadHalf) -> Result<bool, Failure> {
    loop {
        match wire::read_frame(reader).await? {
            Some(frame) if frame.kind == kind::DATA => {}
            Some(frame) if frame.kind == kind::DATA_END => return Ok(true),
            Some(frame) => {
                return Err(fail(
                    "bad_request",
                    format!("frame kind {} in an upload", frame.kind),
                ));
            }
            None => return Ok(false),
        }
    }
}

/// `FILE_WRITE {path, mode?, parents}`, `DATA`…, `DATA_END` → `DONE {size}`.
async fn write(
    request: &Value,
    mut reader: OwnedReadHalf,
    writer: &mut OwnedWriteHalf,
) -> Result<(), Failure> {
    let path = path_field(request, "path")?;
    let mode = permission_bits(optional_number(request, "mode")?.unwrap_or(0o644));
    let parents = flag(request, "parents")?;
    let upload = blocking(move || Upload::begin(path, parents)).await?;
    let (sender, pieces) = mpsc::channel(CHUNKS_QUEUED);
    let worker = tokio::task::spawn_blocking(move || upload.receive(pieces, mode));
    let forwarded = forward(&mut reader, &sender).await;
    // Without `End`, a closed channel tells the worker to give up.
    drop(sender);
    let result = worker
        .await
        .unwrap_or_else(|e| Err(fail("io_error", format!("the upload failed: {e}"))));
    match forwarded {
        Forwarded::Ended | Forwarded::WorkerStopped => {
            let size = result?;
            wire::write_json(writer, kind::DONE, &json!({"size": size})).await?;
            Ok(())
        }
        Forwarded::Gone => Ok(()),
        Forwarded::Refused(failure) => Err(failure),
    }
}

/// An upload under way: its temporary file in the target's directory.
struct Upload {
    path: PathBuf,
    directory: File,
    name: OsString,
    temporary: Temporary,
}

impl Upload {
    fn begin(path: PathBuf, parents: bool) -> Result<Upload, Failure> {
        let Some(name) = path.file_name().map(OsStr::to_owned) else {
            return Err(fail("is_a_directory", "\"/\" is a directory"));
        };
        let parent = path.parent().unwrap_or(Path::new("/")).to_path_buf();
        if parents {
            DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(&parent)
                .map_err(|e| os_failure(e, "create the directory", &parent))?;
        }
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            return Err(fail(
                "is_a_directory",
                format!("{} is a directory", shown(&path)),
            ));
        }
        let directory = OpenOptions::new()
            .read(true)
            .custom_flags(OFlags::DIRECTORY.bits() as i32)
            .open(&parent)
            .map_err(|e| os_failure(e, "open the directory", &parent))?;
        let temporary = create_temporary(&directory, &parent)?;
        Ok(Upload {
            path,
            directory,
            name,
            temporary,
        })
    }

    /// Writes what comes until `End`, then puts the file in place; on any
    /// failure (the connection gone included) the temporary file goes.
    fn receive(self, mut pieces: mpsc::Receiver<Piece>, mode: u32) -> Result<u64, Failure> {
        let size = match self.fill(&mut pieces, mode) {
            Ok(size) => size,
            Err(failure) => {
                self.temporary.discard(&self.directory);
                return Err(failure);
            }
        };
        let placing = |e: io::Error| os_failure(e, "write", &self.path);
        self.temporary
            .place(&self.directory, &self.name)
            .map_err(|e| placing(e.into()))?;
        // The rename itself durable: the directory's entry.
        rustix::fs::fsync(&self.directory).map_err(|e| placing(e.into()))?;
        Ok(size)
    }

    /// Writes the file whole, with its mode, fsynced.
    fn fill(&self, pieces: &mut mpsc::Receiver<Piece>, mode: u32) -> Result<u64, Failure> {
        let mut size = 0u64;
        // The disk writes while the bytes come: the fsync below has little
        // left, and the sandbox's memory holds few dirty pages.
        let mut file = crate::host::WriteBehind::new(&self.temporary.file, 0);
        loop {
            match pieces.blocking_recv() {
                Some(Piece::Bytes(bytes)) => {
                    file.write_all(&bytes)
                        .map_err(|e| os_failure(e, "write", &self.path))?;
                    size += bytes.len() as u64;
                }
                Some(Piece::End) => break,
                None => {
                    return Err(fail("bad_request", "the upload ended before its end frame"));
                }
            }
        }
        let placing = |e: io::Error| os_failure(e, "write", &self.path);
        let written = &self.temporary.file;
        rustix::fs::fchmod(written, Mode::from_raw_mode(mode)).map_err(|e| placing(e.into()))?;
        written.sync_all().map_err(placing)?;
        Ok(size)
    }
}

/// A file being written that takes its final name only once whole.
struct Temporary {
    file: File,
    /// Its `.roost-upload-RANDOM` name where it needed one from the start
    /// (no `O_TMPFILE`); `None`: it has no name until [`Temporary::place`].
    name: Option<OsString>,
}

impl Temporary {
    /// Names the file `name` in `directory`, over a file or symlink there,
    /// in one rename. Where it had no name, it is linked in under a
    /// temporary one first (there a moment, removed if the rename fails).
    fn place(&self, directory: impl AsFd, name: &OsStr) -> rustix::io::Result<()> {
        let temporary = match &self.name {
            Some(temporary) => temporary.clone(),
            None => link_unnamed(&self.file, directory.as_fd())?,
        };
        rustix::fs::renameat(directory.as_fd(), &temporary, directory.as_fd(), name).inspect_err(
            |_| {
                let _ = rustix::fs::unlinkat(directory.as_fd(), &temporary, AtFlags::empty());
            },
        )
    }

    /// Gives the file up: a named one is removed; one of no name goes
    /// with its descriptor.
    fn discard(&self, directory: impl AsFd) {
        if let Some(name) = &self.name {
            let _ = rustix::fs::unlinkat(directory, name, AtFlags::empty());
        }
    }
}

/// A new, empty file in `directory`: of no name (`O_TMPFILE`) where the
/// filesystem can, else `.roost-upload-RANDOM` (`O_EXCL`: never one that
/// exists, nor through a symlink).
fn create_temporary(directory: impl AsFd, parent: &Path) -> Result<Temporary, Failure> {
    // Linked in through /proc/self/fd at the end (AT_EMPTY_PATH would need
    // CAP_DAC_READ_SEARCH, which a sandbox does not have).
    if Path::new("/proc/self/fd").is_dir() {
        let unnamed = rustix::fs::openat(
            directory.as_fd(),
            ".",
            OFlags::WRONLY | OFlags::TMPFILE | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        );
        match unnamed {
            Ok(fd) => {
                return Ok(Temporary {
                    file: File::from(fd),
                    name: None,
                });
            }
            // What a filesystem without O_TMPFILE answers.
            Err(Errno::OPNOTSUPP | Errno::ISDIR | Errno::INVAL) => {}
            Err(e) => return Err(os_failure(e.into(), "create a file in", parent)),
        }
    }
    for _ in 0..8 {
        let name = format!("{UPLOAD_PREFIX}{}", random_hex());
        let created = rustix::fs::openat(
            directory.as_fd(),
            name.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        );
        match created {
            Ok(fd) => {
                return Ok(Temporary {
                    file: File::from(fd),
                    name: Some(OsString::from(name)),
                });
            }
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(os_failure(e.into(), "create a file in", parent)),
        }
    }
    Err(fail(
        "io_error",
        format!("no free temporary name in {}", shown(parent)),
    ))
}

/// Links the unnamed file `file` into `directory` as a fresh
/// `.roost-upload-RANDOM`; returns the name.
fn link_unnamed(file: &File, directory: BorrowedFd<'_>) -> rustix::io::Result<OsString> {
    use std::os::fd::AsRawFd;
    let source = format!("/proc/self/fd/{}", file.as_raw_fd());
    for _ in 0..8 {
        let name = OsString::from(format!("{UPLOAD_PREFIX}{}", random_hex()));
        match rustix::fs::linkat(
            rustix::fs::CWD,
            source.as_str(),
            directory,
            &name,
            AtFlags::SYMLINK_FOLLOW,
        ) {
            Ok(()) => return Ok(name),
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Errno::EXIST)
}

fn random_hex() -> String {
    let mut random = [0u8; 8];
    if getrandom::fill(&mut random).is_err() {
        // O_EXCL still keeps two uploads apart; the name only has to be new.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        random = nanos.to_le_bytes();
    }
    random.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------- list

/// `FILE_LIST {path, depth?}` → `LISTING {entries}`… then `DONE
/// {truncated, count}`.
async fn list(request: &Value, writer: &mut OwnedWriteHalf) -> Result<(), Failure> {
    let path = path_field(request, "path")?;
    let depth = optional_number(request, "depth")?.unwrap_or(1);
    // Depth 0 is the path's own entry, whatever it is (a stat: E2B's
    // `Stat` of a file in a directory past the listing's bounds).
    if depth > LIST_DEPTH_MAX {
        return Err(fail(
            "bad_request",
            format!("depth {depth} is outside 0..={LIST_DEPTH_MAX}"),
        ));
    }
    let (entries, truncated) = blocking(move || walk(&path, depth as usize)).await?;
    let count = entries.len();
    // Several frames, each well under the frame bound.
    let mut batch = Vec::new();
    let mut batch_bytes = 0;
    let mut sent_any = false;
    for entry in entries {
        let entry_bytes = entry.to_string().len() + 1;
        if !batch.is_empty() && batch_bytes + entry_bytes > LISTING_FRAME_BYTES {
            let frame = json!({"entries": std::mem::take(&mut batch)});
            wire::write_json(writer, kind::LISTING, &frame).await?;
            sent_any = true;
            batch_bytes = 0;
        }
        batch_bytes += entry_bytes;
        batch.push(entry);
    }
    if !batch.is_empty() || !sent_any {
        wire::write_json(writer, kind::LISTING, &json!({"entries": batch})).await?;
    }
    let done = json!({"truncated": truncated, "count": count});
    wire::write_json(writer, kind::DONE, &done).await?;
    Ok(())
}

fn entry(path: &Path, metadata: &Metadata) -> Value {
    let mut entry = json!({
        "path": path.to_string_lossy(),
        "type": type_name(metadata),
        "size": metadata.len(),
        "mode": metadata.mode() & 0o7777,
        "mtime_unix_ms": mtime_unix_ms(metadata),
    });
    if metadata.file_type().is_symlink()
        && let Ok(target) = std::fs::read_link(path)
    {
        entry["link_target"] = Value::from(target.to_string_lossy());
    }
    entry
}

/// The entries under `root` down to `depth` levels, breadth first (so a
/// truncated listing has the nearest), sorted by path; a symlink is an
/// entry, never followed. `root` itself, when not a directory or at depth
/// 0, is its one entry.
fn walk(root: &Path, depth: usize) -> Result<(Vec<Value>, bool), Failure> {
    let metadata = std::fs::symlink_metadata(root).map_err(|e| os_failure(e, "list", root))?;
    if !metadata.is_dir() || depth == 0 {
        return Ok((vec![entry(root, &metadata)], false));
    }
    let mut entries = Vec::new();
    let mut json_bytes = 0;
    let mut truncated = false;
    let mut pending = VecDeque::from([(root.to_path_buf(), 1usize)]);
    'walk: while let Some((directory, level)) = pending.pop_front() {
        let reading = match std::fs::read_dir(&directory) {
            Ok(reading) => reading,
            Err(e) if directory == root => return Err(os_failure(e, "list", root)),
            // A subdirectory that went away or cannot be read: its own
            // entry says what it is.
            Err(_) => continue,
        };
        for item in reading {
            let Ok(item) = item else { continue };
            // `DirEntry::metadata` does not follow a symlink.
            let Ok(metadata) = item.metadata() else {
                continue;
            };
            if entries.len() == LIST_ENTRIES_MAX {
                truncated = true;
                break 'walk;
            }
            let path = item.path();
            let listed = entry(&path, &metadata);
            // Its JSON and a separator, as the listing frames will carry it.
            json_bytes += listed.to_string().len() + 1;
            if json_bytes > LIST_JSON_BYTES_MAX {
                truncated = true;
                break 'walk;
            }
            if metadata.is_dir() && level < depth {
                pending.push_back((path, level + 1));
            }
            entries.push(listed);
        }
    }
    entries.sort_by(|a, b| a["path"].as_str().cmp(&b["path"].as_str()));
    Ok((entries, truncated))
}

// ---------------------------------------------------------------- remove, move, mkdir

/// `/` and `/workspace` themselves, also when named through a symlinked
/// parent.
fn refuse_protected(path: &Path, what: &str) -> Result<(), Failure> {
    let protected = |p: &Path| p == Path::new("/") || p == Path::new(WORKSPACE_PATH);
    let through_parent = match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => {
            std::fs::canonicalize(parent).is_ok_and(|real| protected(&real.join(name)))
        }
        _ => false,
    };
    if protected(path) || through_parent {
        return Err(fail(
            "bad_request",
            format!(
                "{} is the sandbox's root or its workspace: it cannot be {what}",
                shown(path)
            ),
        ));
    }
    Ok(())
}

/// `FILE_REMOVE {path, recursive}` → `DONE {}`.
async fn remove(request: &Value, writer: &mut OwnedWriteHalf) -> Result<(), Failure> {
    let path = path_field(request, "path")?;
    let recursive = flag(request, "recursive")?;
    blocking(move || {
        refuse_protected(&path, "removed")?;
        let metadata =
            std::fs::symlink_metadata(&path).map_err(|e| os_failure(e, "remove", &path))?;
        let removed = if !metadata.is_dir() {
            std::fs::remove_file(&path)
        } else if recursive {
            // std's walk unlinks symlinks and never follows them.
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_dir(&path)
        };
        removed.map_err(|e| os_failure(e, "remove", &path))
    })
    .await?;
    wire::write_json(writer, kind::DONE, &json!({})).await?;
    Ok(())
}

/// `FILE_MOVE {from, to, overwrite}` → `DONE {}`: one rename(2).
async fn rename(request: &Value, writer: &mut OwnedWriteHalf) -> Result<(), Failure> {
    let from = path_field(request, "from")?;
    let to = path_field(request, "to")?;
    let overwrite = flag(request, "overwrite")?;
    blocking(move || {
        refuse_protected(&from, "moved")?;
        let moving = |e: io::Error| os_failure(e, "move to", &to);
        if overwrite {
            return std::fs::rename(&from, &to).map_err(|e| os_failure(e, "move", &from));
        }
        match rustix::fs::renameat_with(CWD, &from, CWD, &to, RenameFlags::NOREPLACE) {
            Ok(()) => Ok(()),
            Err(Errno::EXIST) => Err(fail(
                "already_exists",
                format!("{} exists (ask to overwrite it)", shown(&to)),
            )),
            // A filesystem without RENAME_NOREPLACE: look, then rename.
            Err(Errno::INVAL) if std::fs::symlink_metadata(&to).is_ok() => Err(fail(
                "already_exists",
                format!("{} exists (ask to overwrite it)", shown(&to)),
            )),
            Err(Errno::INVAL) => std::fs::rename(&from, &to).map_err(moving),
            Err(Errno::NOENT) if std::fs::symlink_metadata(&from).is_err() => Err(fail(
                "not_found",
                format!("{} does not exist", shown(&from)),
            )),
            Err(e) => Err(moving(e.into())),
        }
    })
    .await?;
    wire::write_json(writer, kind::DONE, &json!({})).await?;
    Ok(())
}

/// `FILE_MKDIR {path, parents, mode?}` → `DONE {created}`. With
/// `parents`, an existing directory is fine (`created: false`).
async fn mkdir(request: &Value, writer: &mut OwnedWriteHalf) -> Result<(), Failure> {
    let path = path_field(request, "path")?;
    let parents = flag(request, "parents")?;
    let mode = permission_bits(optional_number(request, "mode")?.unwrap_or(0o755));
    let created = blocking(move || {
        if parents && let Some(parent) = path.parent() {
            DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent)
                .map_err(|e| os_failure(e, "create the directory", parent))?;
        }
        match DirBuilder::new().mode(mode).create(&path) {
            Ok(()) => {
                // The mode as asked, whatever the umask.
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                    .map_err(|e| os_failure(e, "set the mode of", &path))?;
                Ok(true)
            }
            Err(e)
                if e.kind() == io::ErrorKind::AlreadyExists
                    && parents
                    && std::fs::metadata(&path).is_ok_and(|m| m.is_dir()) =>
            {
                Ok(false)
            }
            Err(e) => Err(os_failure(e, "create the directory", &path)),
        }
    })
    .await?;
    wire::write_json(writer, kind::DONE, &json!({"created": created})).await?;
    Ok(())
}

// ---------------------------------------------------------------- tar

/// What a tar stream moved.
#[derive(Default)]
struct TarCount {
    files: u64,
    directories: u64,
    symlinks: u64,
    bytes: u64,
    skipped: u64,
}

impl TarCount {
    fn json(&self) -> Value {
        json!({
            "files": self.files,
            "directories": self.directories,
            "symlinks": self.symlinks,
            "bytes": self.bytes,
            "skipped": self.skipped,
        })
    }
}

/// `TAR_READ {path}` → `DATA`… (a tar stream), `DONE {files, directories,
/// symlinks, bytes, skipped}`.
async fn tar_read(request: &Value, writer: &mut OwnedWriteHalf) -> Result<(), Failure> {
    let path = path_field(request, "path")?;
    let opened = path.clone();
    let root = blocking(move || {
        rustix::fs::open(
            &opened,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            // O_NOFOLLOW on a symlink, O_DIRECTORY on anything else.
            Errno::LOOP | Errno::NOTDIR => fail(
                "not_a_directory",
                format!("{} is not a directory", shown(&opened)),
            ),
            e => os_failure(e.into(), "open", &opened),
        })
    })
    .await?;
    let (sender, mut chunks) = mpsc::channel(CHUNKS_QUEUED);
    let worker = tokio::task::spawn_blocking(move || pack(root, &path, sender));
    while let Some(chunk) = chunks.recv().await {
        wire::write_frame(writer, kind::DATA, &chunk).await?;
    }
    let count = worker
        .await
        .unwrap_or_else(|e| Err(fail("io_error", format!("the tar stream failed: {e}"))))?;
    wire::write_json(writer, kind::DONE, &count.json()).await?;
    Ok(())
}

/// The tar stream's bytes, handed to the connection in chunks.
struct ChunkWriter {
    sender: mpsc::Sender<Vec<u8>>,
    buffer: Vec<u8>,
}

impl ChunkWriter {
    fn send(&mut self) -> io::Result<()> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buffer, Vec::with_capacity(DATA_BYTES_MAX));
        self.sender
            .blocking_send(chunk)
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the runner went away"))
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let room = DATA_BYTES_MAX - self.buffer.len();
        let taken = bytes.len().min(room);
        self.buffer.extend_from_slice(&bytes[..taken]);
        if self.buffer.len() == DATA_BYTES_MAX {
            self.send()?;
        }
        Ok(taken)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

/// One directory being read by [`pack`].
struct Level {
    entries: Dir,
    path: PathBuf,
}

/// Writes the tree under `root` as a tar stream, walking by descriptors
/// (`O_NOFOLLOW` at every step: nothing outside the directory).
fn pack(
    root: OwnedFd,
    root_path: &Path,
    sender: mpsc::Sender<Vec<u8>>,
) -> Result<TarCount, Failure> {
    let out = ChunkWriter {
        sender,
        buffer: Vec::with_capacity(DATA_BYTES_MAX),
    };
    let mut builder = tar::Builder::new(out);
    let mut count = TarCount::default();
    let sending = |e: io::Error| fail("io_error", format!("cannot send the tar stream: {e}"));
    let listing = |e: Errno, path: &Path| os_failure(e.into(), "list", &root_path.join(path));
    let mut stack = vec![Level {
        entries: Dir::new(root).map_err(|e| listing(e, Path::new("")))?,
        path: PathBuf::new(),
    }];
    while let Some(level) = stack.last_mut() {
        let Some(item) = level.entries.next() else {
            stack.pop();
            continue;
        };
        let item = item.map_err(|e| listing(e, &level.path))?;
        let name = item.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let path = level.path.join(OsStr::from_bytes(name.to_bytes()));
        let directory = level.entries.fd().map_err(|e| listing(e, &level.path))?;
        match pack_entry(&mut builder, directory, name, &path, &mut count) {
            Ok(Some(entries)) => {
                if stack.len() >= TAR_DEPTH_MAX {
                    return Err(fail(
                        "bad_request",
                        format!(
                            "{} is more than {TAR_DEPTH_MAX} levels deep",
                            shown(&root_path.join(&path))
                        ),
                    ));
                }
                stack.push(Level { entries, path });
            }
            Ok(None) => {}
            Err(PackError::Send(e)) => return Err(sending(e)),
            Err(PackError::Read(e, what)) => {
                return Err(os_failure(e, what, &root_path.join(&path)));
            }
        }
    }
    let mut out = builder.into_inner().map_err(sending)?;
    out.flush().map_err(sending)?;
    Ok(count)
}

enum PackError {
    /// The stream could not go out (the runner went away).
    Send(io::Error),
    /// The tree could not be read.
    Read(io::Error, &'static str),
}

/// Appends entry `name` of `directory`; a subdirectory comes back to be
/// walked. An entry that vanished or changed type meanwhile is left out.
fn pack_entry(
    builder: &mut tar::Builder<ChunkWriter>,
    directory: BorrowedFd<'_>,
    name: &CStr,
    path: &Path,
    count: &mut TarCount,
) -> Result<Option<Dir>, PackError> {
    let read = |e: Errno, what| PackError::Read(e.into(), what);
    let stat = match rustix::fs::statat(directory, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => stat,
        Err(Errno::NOENT) => return Ok(None),
        Err(e) => return Err(read(e, "stat")),
    };
    let mut header = tar::Header::new_gnu();
    header.set_mode((stat.st_mode & 0o777) as u32);
    header.set_mtime(u64::try_from(stat.st_mtime).unwrap_or(0));
    header.set_uid(u64::from(stat.st_uid));
    header.set_gid(u64::from(stat.st_gid));
    match FileType::from_raw_mode(stat.st_mode) {
        FileType::RegularFile => {
            let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
            let fd = match rustix::fs::openat(directory, name, flags, Mode::empty()) {
                Ok(fd) => fd,
                // Gone, or a symlink now: skipped like any change racing the walk.
                Err(Errno::NOENT | Errno::LOOP) => return Ok(None),
                Err(e) => return Err(read(e, "open")),
            };
            let stat = rustix::fs::fstat(&fd).map_err(|e| read(e, "stat"))?;
            if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
                count.skipped += 1;
                return Ok(None);
            }
            let size = u64::try_from(stat.st_size).unwrap_or(0);
            header.set_entry_type(tar::EntryType::Regular);
            header.set_mode((stat.st_mode & 0o777) as u32);
            header.set_size(size);
            // Exactly `size` bytes whatever happens to the file meanwhile
            // (a short file is padded with zeros): the header said so.
            let data = File::from(fd).take(size).chain(io::repeat(0)).take(size);
            builder
                .append_data(&mut header, path, data)
                .map_err(PackError::Send)?;
            count.files += 1;
            count.bytes += size;
            Ok(None)
        }
        FileType::Directory => {
            let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            let fd = match rustix::fs::openat(directory, name, flags, Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR) => return Ok(None),
                Err(e) => return Err(read(e, "open")),
            };
            header.set_entry_type(tar::EntryType::Directory);
            header.set_size(0);
            builder
                .append_data(&mut header, path, io::empty())
                .map_err(PackError::Send)?;
            count.directories += 1;
            Ok(Some(Dir::new(fd).map_err(|e| read(e, "list"))?))
        }
        FileType::Symlink => {
            let target = match rustix::fs::readlinkat(directory, name, Vec::new()) {
                Ok(target) => target,
                Err(Errno::NOENT | Errno::INVAL) => return Ok(None),
                Err(e) => return Err(read(e, "read the link")),
            };
            header.set_entry_type(tar::EntryType::Symlink);
            header.set_size(0);
            builder
                .append_link(&mut header, path, OsStr::from_bytes(target.as_bytes()))
                .map_err(PackError::Send)?;
            count.symlinks += 1;
            Ok(None)
        }
        _ => {
            count.skipped += 1;
            Ok(None)
        }
    }
}

/// `TAR_WRITE {path}`, `DATA`… (a tar stream), `DATA_END` → `DONE
/// {files, directories, symlinks, bytes, skipped}`.
async fn tar_write(
    request: &Value,
    mut reader: OwnedReadHalf,
    writer: &mut OwnedWriteHalf,
) -> Result<(), Failure> {
    let path = path_field(request, "path")?;
    let opened = path.clone();
    let root = blocking(move || {
        DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&opened)
            .map_err(|e| os_failure(e, "create the directory", &opened))?;
        rustix::fs::open(
            &opened,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| os_failure(e.into(), "open", &opened))
    })
    .await?;
    let (sender, pieces) = mpsc::channel(CHUNKS_QUEUED);
    let worker = tokio::task::spawn_blocking(move || {
        let incoming = Incoming {
            pieces,
            chunk: Vec::new(),
            at: 0,
            ended: false,
        };
        Unpacker::new(root, path).unpack(incoming)
    });
    let forwarded = forward(&mut reader, &sender).await;
    drop(sender);
    let result = worker
        .await
        .unwrap_or_else(|e| Err(fail("io_error", format!("the tar stream failed: {e}"))));
    let count = match forwarded {
        Forwarded::Ended => result?,
        Forwarded::WorkerStopped => {
            let count = result?;
            // The archive ended before the runner's stream: the rest is
            // padding (or nothing anyone reads).
            if !drain_to_end(&mut reader).await? {
                return Ok(());
            }
            count
        }
        Forwarded::Gone => return Ok(()),
        Forwarded::Refused(failure) => return Err(failure),
    };
    wire::write_json(writer, kind::DONE, &count.json()).await?;
    Ok(())
}

/// The runner's bytes as a blocking reader for the tar crate.
struct Incoming {
    pieces: mpsc::Receiver<Piece>,
    chunk: Vec<u8>,
    at: usize,
    ended: bool,
}

impl Read for Incoming {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        while self.at == self.chunk.len() {
            if self.ended {
                return Ok(0);
            }
            match self.pieces.blocking_recv() {
                Some(Piece::Bytes(bytes)) => {
                    self.chunk = bytes;
                    self.at = 0;
                }
                Some(Piece::End) => self.ended = true,
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the runner went away before the end of the stream",
                    ));
                }
            }
        }
        let n = buffer.len().min(self.chunk.len() - self.at);
        buffer[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// An entry's path as components (empty for the root itself): refused
/// when absolute or with a `..` component.
fn entry_components(raw: &[u8]) -> Result<Vec<OsString>, &'static str> {
    if raw.starts_with(b"/") {
        return Err("is absolute");
    }
    let mut components = Vec::new();
    for component in raw.split(|b| *b == b'/') {
        match component {
            b"" | b"." => {}
            b".." => return Err("has a `..` component"),
            name => components.push(OsStr::from_bytes(name).to_owned()),
        }
    }
    Ok(components)
}

/// An entry refused: the whole stream stops there.
fn refused(raw: &[u8], why: &str) -> Failure {
    fail(
        "bad_request",
        format!(
            "tar entry {} {why}: the stream is refused from there (what came before it is unpacked)",
            shown(Path::new(OsStr::from_bytes(raw)))
        ),
    )
}

/// The stream itself could not be read.
fn broken(e: io::Error) -> Failure {
    fail(
        "bad_request",
        format!("the tar stream is broken: {e} (what came before it is unpacked)"),
    )
}

/// Why a directory on an entry's way could not be opened.
enum Way {
    /// A symlink or a non-directory stands where a directory should.
    Blocked(OsString),
    Failed(Errno),
}

/// The directory at `components` under `root`, opened one component at a
/// time with `O_NOFOLLOW` (a symlink anywhere on the way refuses), made
/// (0755) where missing when `create`. `None` is `root` itself.
fn open_beneath(
    root: &OwnedFd,
    components: &[OsString],
    create: bool,
) -> Result<Option<OwnedFd>, Way> {
    let mut current: Option<OwnedFd> = None;
    for component in components {
        let directory = current.as_ref().map_or(root.as_fd(), |fd| fd.as_fd());
        if create {
            match rustix::fs::mkdirat(directory, component, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(Way::Failed(e)),
            }
        }
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        match rustix::fs::openat(directory, component, flags, Mode::empty()) {
            Ok(fd) => current = Some(fd),
            Err(Errno::LOOP | Errno::NOTDIR) => return Err(Way::Blocked(component.clone())),
            Err(e) => return Err(Way::Failed(e)),
        }
    }
    Ok(current)
}

/// Unpacks a tar stream under one directory, by descriptors.
struct Unpacker {
    root: OwnedFd,
    root_path: PathBuf,
    /// The directory the last entry went into (`None`: the root), kept
    /// open for the next one.
    current_path: Vec<OsString>,
    current: Option<OwnedFd>,
    buffer: Vec<u8>,
    count: TarCount,
}

impl Unpacker {
    fn new(root: OwnedFd, root_path: PathBuf) -> Unpacker {
        Unpacker {
            root,
            root_path,
            current_path: Vec::new(),
            current: None,
            buffer: vec![0u8; DATA_BYTES_MAX],
            count: TarCount::default(),
        }
    }

    fn unpack(mut self, incoming: impl Read) -> Result<TarCount, Failure> {
        let mut archive = tar::Archive::new(incoming);
        for entry in archive.entries().map_err(broken)? {
            let mut entry = entry.map_err(broken)?;
            self.entry(&mut entry)?;
        }
        Ok(self.count)
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), Failure> {
        let raw = entry.path_bytes().into_owned();
        let mut components = entry_components(&raw).map_err(|why| refused(&raw, why))?;
        let header = entry.header();
        let entry_type = header.entry_type();
        // Permission bits only: setuid, setgid and sticky are cleared.
        let mode = header.mode().map_err(broken)? & 0o777;
        let mtime = header.mtime().map_err(broken)?;
        match entry_type {
            tar::EntryType::Regular
            | tar::EntryType::Continuous
            | tar::EntryType::GNUSparse
            | tar::EntryType::Directory
            | tar::EntryType::Symlink
            | tar::EntryType::Link => {}
            // A PAX global header describes the archive, not a file.
            tar::EntryType::XGlobalHeader => return Ok(()),
            // Device nodes, fifos and whatever else: never made.
            _ => {
                self.count.skipped += 1;
                return Ok(());
            }
        }
        let Some(name) = components.pop() else {
            // The root itself ("./"): it is there already.
            return Ok(());
        };
        self.enter(&components, &raw)?;
        let parent = match &self.current {
            Some(fd) => fd.as_fd(),
            None => self.root.as_fd(),
        };
        let path = self.root_path.join(OsStr::from_bytes(&raw));
        let failed = |e: Errno, what: &str| os_failure(e.into(), what, &path);
        match entry_type {
            tar::EntryType::Directory => {
                match rustix::fs::mkdirat(parent, &name, Mode::from_raw_mode(0o700)) {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(failed(e, "create the directory")),
                }
                let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                let directory = match rustix::fs::openat(parent, &name, flags, Mode::empty()) {
                    Ok(fd) => fd,
                    Err(Errno::LOOP | Errno::NOTDIR) => {
                        return Err(refused(&raw, "is a directory where a symlink or a file is"));
                    }
                    Err(e) => return Err(failed(e, "open")),
                };
                rustix::fs::fchmod(&directory, Mode::from_raw_mode(mode))
                    .map_err(|e| failed(e, "set the mode of"))?;
                self.count.directories += 1;
            }
            tar::EntryType::Symlink => {
                let target = entry.link_name_bytes().map(|t| t.into_owned());
                let target = target.ok_or_else(|| refused(&raw, "has no link target"))?;
                clear_way(parent, &name, &raw, &path)?;
                rustix::fs::symlinkat(OsStr::from_bytes(&target), parent, &name)
                    .map_err(|e| failed(e, "create the symlink"))?;
                self.count.symlinks += 1;
            }
            tar::EntryType::Link => {
                let target = entry.link_name_bytes().map(|t| t.into_owned());
                let target = target.ok_or_else(|| refused(&raw, "has no link target"))?;
                let mut target_components = entry_components(&target)
                    .map_err(|why| refused(&raw, &format!("links to a path that {why}")))?;
                let target_name = target_components
                    .pop()
                    .ok_or_else(|| refused(&raw, "links to the root"))?;
                let target_directory = match open_beneath(&self.root, &target_components, false) {
                    Ok(fd) => fd,
                    Err(Way::Blocked(_)) => {
                        return Err(refused(&raw, "links through a symlink"));
                    }
                    Err(Way::Failed(e)) => return Err(failed(e, "link")),
                };
                let target_parent = target_directory
                    .as_ref()
                    .map_or(self.root.as_fd(), |fd| fd.as_fd());
                clear_way(parent, &name, &raw, &path)?;
                // Without AT_SYMLINK_FOLLOW: a link to a symlink links the
                // symlink itself, never what it points at.
                rustix::fs::linkat(target_parent, &target_name, parent, &name, AtFlags::empty())
                    .map_err(|e| failed(e, "link"))?;
                self.count.files += 1;
            }
            _ => {
                // Written beside its name and renamed over it once whole:
                // what the name held stays until then, and a stream cut, a
                // full disk or a killed agent never leaves part of a file
                // under it (nor, where the file has no name until then,
                // anything at all: `Temporary`).
                let directory_path = path.parent().unwrap_or(&self.root_path).to_path_buf();
                let temporary = create_temporary(parent, &directory_path)?;
                let file = &temporary.file;
                let announced = entry.size();
                let written = copy_entry(entry, file, &mut self.buffer).and_then(|size| {
                    // The tar crate reads an entry cut short as a short one.
                    if size != announced {
                        return Err(Copy::Read(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!(
                                "the stream ends inside an entry ({size} of {announced} bytes)"
                            ),
                        )));
                    }
                    rustix::fs::fchmod(file, Mode::from_raw_mode(mode))
                        .map_err(|e| Copy::Write(e.into()))?;
                    let time = rustix::fs::Timespec {
                        tv_sec: i64::try_from(mtime).unwrap_or(0),
                        tv_nsec: 0,
                    };
                    let times = Timestamps {
                        last_access: time,
                        last_modification: time,
                    };
                    // A time the filesystem refuses costs nothing.
                    let _ = rustix::fs::futimens(file, &times);
                    Ok(size)
                });
                let size = match written {
                    Ok(size) => size,
                    Err(failure) => {
                        temporary.discard(parent);
                        return Err(match failure {
                            Copy::Read(e) => broken(e),
                            Copy::Write(e) => os_failure(e, "write", &path),
                        });
                    }
                };
                // Over a file or a symlink (never followed): replaced at
                // once. Over a directory: refused, as before.
                if let Err(e) = temporary.place(parent, &name) {
                    return Err(match e {
                        Errno::ISDIR | Errno::NOTEMPTY | Errno::EXIST => {
                            refused(&raw, "is a file where a directory is")
                        }
                        e => failed(e, "replace"),
                    });
                }
                self.count.files += 1;
                self.count.bytes += size;
            }
        }
        Ok(())
    }

    /// Opens (making it where missing) the directory an entry goes into,
    /// unless it is the last entry's.
    fn enter(&mut self, components: &[OsString], raw: &[u8]) -> Result<(), Failure> {
        if components == self.current_path.as_slice() {
            return Ok(());
        }
        // Whatever happens next, the cached directory is no longer known.
        self.current = None;
        self.current_path.clear();
        match open_beneath(&self.root, components, true) {
            Ok(fd) => {
                self.current = fd;
                self.current_path = components.to_vec();
                Ok(())
            }
            Err(Way::Blocked(component)) => Err(refused(
                raw,
                &format!(
                    "goes through {} which is a symlink or not a directory (never followed)",
                    shown(Path::new(&component))
                ),
            )),
            Err(Way::Failed(e)) => Err(os_failure(
                e.into(),
                "create the directories of",
                &self.root_path.join(OsStr::from_bytes(raw)),
            )),
        }
    }
}

/// Which side of a copy failed.
enum Copy {
    Read(io::Error),
    Write(io::Error),
}

fn copy_entry<R: Read>(entry: &mut R, mut file: &File, buffer: &mut [u8]) -> Result<u64, Copy> {
    let mut size = 0u64;
    loop {
        let n = match entry.read(buffer) {
            Ok(0) => return Ok(size),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Copy::Read(e)),
        };
        file.write_all(&buffer[..n]).map_err(Copy::Write)?;
        size += n as u64;
    }
}

/// Removes what is at `name` so an entry can take its place; a directory
/// in the way refuses the entry.
fn clear_way(parent: BorrowedFd<'_>, name: &OsStr, raw: &[u8], path: &Path) -> Result<(), Failure> {
    match rustix::fs::unlinkat(parent, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(Errno::ISDIR | Errno::PERM) => Err(refused(raw, "is a file where a directory is")),
        Err(e) => Err(os_failure(e.into(), "replace", path)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_stops_at_its_json_bound_and_says_truncated() {
        let scratch = tempfile::tempdir().expect("tempdir");
        // Long names, nested: each entry's JSON is about 3 KiB, so the
        // JSON bound comes long before the entries' bound.
        let mut deep = scratch.path().to_path_buf();
        for level in 0..10 {
            deep.push(format!("{level}{}", "d".repeat(250)));
        }
        std::fs::create_dir_all(&deep).expect("deep directory");
        let files = LIST_JSON_BYTES_MAX / 2_500;
        assert!(files < LIST_ENTRIES_MAX);
        for i in 0..files {
            std::fs::write(deep.join(format!("{i:05}{}", "f".repeat(240))), b"").expect("file");
        }
        let (entries, truncated) = walk(&deep, 1).expect("listed");
        assert!(truncated, "{} entries", entries.len());
        let json: usize = entries.iter().map(|e| e.to_string().len() + 1).sum();
        assert!(json <= LIST_JSON_BYTES_MAX, "{json} bytes");
        assert!(entries.len() > files / 2, "{} entries", entries.len());
        // A listing under both bounds is whole.
        let (entries, truncated) = walk(scratch.path(), 2).expect("listed");
        assert_eq!((entries.len(), truncated), (2, false));
        // Depth 0 is the path's own entry, a directory's too, however
        // many it holds.
        for path in [
            deep.as_path(),
            &deep.join(format!("{:05}{}", files - 1, "f".repeat(240))),
        ] {
            let (entries, truncated) = walk(path, 0).expect("stat");
            assert!(!truncated);
            assert_eq!(entries.len(), 1);
            assert_eq!(entries[0]["path"], path.to_string_lossy().as_ref());
        }
    }

    #[test]
    fn request_paths_are_the_sandboxs_and_bad_ones_are_refused() {
        let check = |raw: &str, expected: Option<&str>| {
            let got = sandbox_path(raw).ok();
            assert_eq!(got.as_deref(), expected.map(Path::new), "{raw:?}");
        };
        check("a.txt", Some("/workspace/a.txt"));
        check("./src//main.rs/", Some("/workspace/src/main.rs"));
        check(".", Some("/workspace"));
        check("/etc/passwd", Some("/etc/passwd"));
        check("/", Some("/"));
        check("a..b/..c", Some("/workspace/a..b/..c"));
        check("", None);
        check("..", None);
        check("a/../b", None);
        check("/workspace/..", None);
        check("a\0b", None);
        check(&"x".repeat(PATH_BYTES_MAX + 1), None);
        assert!(sandbox_path(&"x".repeat(PATH_BYTES_MAX)).is_ok());
    }

    /// A tar of one regular file `name` holding `content`.
    fn one_file_tar(name: &str, content: &[u8]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(content.len() as u64);
        header.set_mode(0o640);
        header.set_cksum();
        builder
            .append_data(&mut header, name, content)
            .expect("append");
        builder.into_inner().expect("tar")
    }

    fn unpack_into(root: &Path, tar: &[u8]) -> Result<TarCount, Failure> {
        let fd = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .expect("open the root");
        Unpacker::new(fd, root.to_path_buf()).unpack(tar)
    }

    /// Audit finding (data path): a tar upload unlinked the file an entry
    /// replaced, then wrote the entry in place: a stream cut mid-entry lost
    /// the old file, and a killed agent left part of the new one under its
    /// name. Now the old file stays whole until the new one is, and no
    /// temporary is left.
    #[test]
    fn a_tar_entry_cut_short_leaves_the_file_it_replaces_whole() {
        let scratch = tempfile::tempdir().expect("tempdir");
        let root = scratch.path();
        std::fs::write(root.join("a.txt"), "old").expect("write");
        let new = vec![b'n'; 100_000];
        let tar = one_file_tar("a.txt", &new);
        // Cut inside the entry's data.
        assert!(unpack_into(root, &tar[..50_000]).is_err());
        assert_eq!(std::fs::read(root.join("a.txt")).expect("read"), b"old");
        let names: Vec<_> = std::fs::read_dir(root)
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["a.txt"], "a temporary was left");

        // Whole: replaced, with the entry's mode.
        let count = unpack_into(root, &tar).expect("unpacked");
        assert_eq!(count.files, 1);
        assert_eq!(std::fs::read(root.join("a.txt")).expect("read"), new);
        let mode = std::fs::metadata(root.join("a.txt"))
            .expect("stat")
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o640
        );

        // A directory where the file goes is refused, and kept.
        std::fs::create_dir(root.join("d")).expect("mkdir");
        std::fs::write(root.join("d/inside"), "x").expect("write");
        assert!(unpack_into(root, &one_file_tar("d", b"file")).is_err());
        assert_eq!(std::fs::read(root.join("d/inside")).expect("kept"), b"x");
    }

    #[test]
    fn tar_entry_paths_are_relative_without_dotdot() {
        let names = |raw: &[u8]| {
            entry_components(raw).map(|c| {
                c.iter()
                    .map(|s| s.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(
            names(b"a/b/c.txt"),
            Ok(vec!["a".into(), "b".into(), "c.txt".into()])
        );
        assert_eq!(names(b"./dir/"), Ok(vec!["dir".into()]));
        assert_eq!(names(b"./"), Ok(vec![]));
        assert!(names(b"/etc/passwd").is_err());
        assert!(names(b"a/../../b").is_err());
        assert!(names(b"..").is_err());
    }

    #[test]
    fn errnos_map_to_stable_codes() {
        assert_eq!(errno_code(Errno::NOSPC), "insufficient_storage");
        assert_eq!(errno_code(Errno::DQUOT), "insufficient_storage");
        assert_eq!(errno_code(Errno::ROFS), "permission_denied");
        assert_eq!(errno_code(Errno::XDEV), "cross_device");
        assert_eq!(errno_code(Errno::NOTEMPTY), "directory_not_empty");
        assert_eq!(errno_code(Errno::IO), "io_error");
    }

    /// Regression: a tar stream's worker that stopped at the archive's end
    /// before `DATA_END` came made the agent wait for a second `DATA_END`
    /// (and the runner for an answer) forever.
    #[tokio::test]
    async fn data_end_is_taken_even_when_the_worker_stopped_first() {
        let (ours, theirs) = tokio::net::UnixStream::pair().expect("pair");
        let (mut reader, _writer) = ours.into_split();
        let (_their_reader, mut their_writer) = theirs.into_split();
        wire::write_frame(&mut their_writer, kind::DATA_END, b"")
            .await
            .expect("send");
        let (sender, receiver) = mpsc::channel(CHUNKS_QUEUED);
        drop(receiver);
        assert!(matches!(
            forward(&mut reader, &sender).await,
            Forwarded::Ended
        ));
    }
}
