//! Host helpers every part of the OCI layer shares: finding a binary, the
//! one runner of host tools (`ip`, `iptables`, `btrfs`, `mount`, `ld.so`…),
//! file writes that replace atomically or durably, write-behind for large
//! files ([`WriteBehind`]), directory sync, the
//! blocking bridge for async callers, and reading `/proc/self/mountinfo`
//! fields. A leaf: it imports nothing of the crate but [`crate::error`].

use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::{Error, Result};

/// An executable named `name` in one of `search_path`'s directories.
pub fn find_binary(search_path: &OsStr, name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(search_path)
        .map(|dir| dir.join(name))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// How a host tool's run failed. The caller turns it into the error of its
/// own trade ([`Error::Network`] for `ip`, [`Error::Io`] on a path for
/// `btrfs`…), with [`ToolFailure::command`] and what the tool said.
#[derive(Debug)]
pub struct ToolFailure {
    /// The command line, for messages: `program arg…`.
    pub command: String,
    pub kind: ToolFailureKind,
}

#[derive(Debug)]
pub enum ToolFailureKind {
    /// The tool could not be started, fed its input or waited for.
    Run {
        step: ToolStep,
        source: std::io::Error,
    },
    /// It ran and failed: its exit status (`None`: killed by a signal) and
    /// its stderr.
    Exited { status: Option<i32>, stderr: String },
}

/// The step of running a tool that failed before it could say anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolStep {
    Start,
    WriteInput,
    Wait,
}

impl std::fmt::Display for ToolStep {
    /// As in "could not {step}".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ToolStep::Start => "start it",
            ToolStep::WriteInput => "write its input",
            ToolStep::Wait => "wait for it",
        })
    }
}

impl ToolFailure {
    /// The stderr lines of a tool that ran and failed, trimmed, blank ones
    /// dropped, joined by `separator`; empty when it never ran.
    pub fn said(&self, separator: &str) -> String {
        match &self.kind {
            ToolFailureKind::Exited { stderr, .. } => stderr
                .lines()
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .collect::<Vec<_>>()
                .join(separator),
            ToolFailureKind::Run { .. } => String::new(),
        }
    }
}

/// Runs `program args…` (with `stdin`, if any) and returns its stdout.
/// Blocking: async code calls it through [`blocking`].
pub fn run_tool<A: AsRef<OsStr>>(
    program: impl AsRef<OsStr>,
    args: &[A],
    stdin: Option<&str>,
) -> Result<String, ToolFailure> {
    let mut command = Command::new(program);
    command.args(args);
    run_command(command, stdin)
}

/// [`run_tool`] of a command the caller built (its environment set, say).
/// A failure names the program and its arguments, never its environment.
pub fn run_command(mut command: Command, stdin: Option<&str>) -> Result<String, ToolFailure> {
    let text = std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(OsStr::to_string_lossy)
        .collect::<Vec<_>>()
        .join(" ");
    let command_text = text.clone();
    let failed = |step: ToolStep, source: std::io::Error| ToolFailure {
        command: command_text.clone(),
        kind: ToolFailureKind::Run { step, source },
    };
    let mut child = command
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| failed(ToolStep::Start, e))?;
    if let Some(input) = stdin
        && let Some(mut pipe) = child.stdin.take()
    {
        // The inputs are a few hundred bytes, far below a pipe's buffer, so
        // writing all before reading cannot deadlock.
        pipe.write_all(input.as_bytes())
            .map_err(|e| failed(ToolStep::WriteInput, e))?;
    }
    let output = child
        .wait_with_output()
        .map_err(|e| failed(ToolStep::Wait, e))?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    Err(ToolFailure {
        command: text,
        kind: ToolFailureKind::Exited {
            status: output.status.code(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        },
    })
}

/// Replaces `path` with `contents` atomically (a temporary file renamed
/// over it): a reader sees the old file or the new one, never half of
/// one. Not fsynced: it survives this process dying, not the host (for
/// files rebuilt at every create: config.json, process.json, resolv.conf).
pub fn write_file(path: &Path, contents: &[u8]) -> Result<()> {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, contents).map_err(|e| Error::io("write", &temporary, e))?;
    std::fs::rename(&temporary, path).map_err(|e| Error::io("rename into", path, e))
}

/// As [`write_file`], and durable: temporary file → fsync → rename → fsync
/// the directory, so after a host crash `path` holds the old contents or
/// the new ones.
pub fn write_durably(path: &Path, contents: &[u8]) -> Result<()> {
    let temporary = path.with_extension("tmp");
    let mut file = File::create(&temporary).map_err(|e| Error::io("create", &temporary, e))?;
    file.write_all(contents)
        .and_then(|()| file.sync_all())
        .map_err(|e| Error::io("write", &temporary, e))?;
    std::fs::rename(&temporary, path).map_err(|e| Error::io("rename into", path, e))?;
    match path.parent() {
        Some(parent) => sync_dir(parent),
        None => Ok(()),
    }
}

/// fsyncs directory `dir`: the names created, renamed or removed in it
/// survive a host crash.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|file| file.sync_all())
        .map_err(|e| Error::io("sync", dir, e))
}

/// How many bytes [`WriteBehind`] hands to writeback at a time.
const WRITE_BEHIND_WINDOW: u64 = 8 << 20;
/// How many windows may be under writeback before a write waits for the
/// oldest: bounds the dirty bytes one large file holds to about 40 MiB.
const WRITE_BEHIND_IN_FLIGHT: usize = 4;

/// A writer for a large file that is fsynced at its end (an upload, a
/// download): each 8 MiB written is handed to the disk at once
/// (`sync_file_range`), and with more than four such windows still
/// being written a write waits for the oldest. The disk then works while the bytes arrive,
/// instead of taking the whole file at the final fsync, and the file
/// holds few dirty pages (in a sandbox, they count against its memory).
///
/// Only the final fsync makes the file durable; this changes when the
/// disk works, never what is promised. A writeback error a wait returns
/// is the write's error: the kernel reports it once per open file, so
/// the fsync after it would not.
pub struct WriteBehind<W> {
    inner: W,
    /// Bytes in the file so far (its offset when it was handed over, plus
    /// what was written through here).
    written: u64,
    /// Where the next window starts.
    next_window: u64,
    /// Windows under writeback, oldest first: their starts.
    in_flight: std::collections::VecDeque<u64>,
    /// Off where the filesystem has no `sync_file_range` (a pipe, FUSE).
    unsupported: bool,
}

impl<W: Write + std::os::fd::AsFd> WriteBehind<W> {
    /// Writes through `inner`, whose file already holds `offset` bytes
    /// (0 for a new file; an appended file's length).
    pub fn new(inner: W, offset: u64) -> WriteBehind<W> {
        WriteBehind {
            inner,
            written: offset,
            next_window: offset - offset % WRITE_BEHIND_WINDOW,
            in_flight: std::collections::VecDeque::new(),
            unsupported: false,
        }
    }

    /// The writer back (to fsync it).
    pub fn into_inner(self) -> W {
        self.inner
    }

    fn hand_over_full_windows(&mut self) -> std::io::Result<()> {
        while !self.unsupported && self.written - self.next_window >= WRITE_BEHIND_WINDOW {
            let start = self.next_window;
            match sync_file_range(&self.inner, start, WRITE_BEHIND_WINDOW, false) {
                Ok(()) => {}
                Err(err) if write_behind_unsupported(&err) => {
                    self.unsupported = true;
                    return Ok(());
                }
                Err(err) => return Err(err),
            }
            self.next_window += WRITE_BEHIND_WINDOW;
            self.in_flight.push_back(start);
            if self.in_flight.len() > WRITE_BEHIND_IN_FLIGHT
                && let Some(oldest) = self.in_flight.pop_front()
            {
                sync_file_range(&self.inner, oldest, WRITE_BEHIND_WINDOW, true)?;
            }
        }
        Ok(())
    }
}

impl<W: Write + std::os::fd::AsFd> Write for WriteBehind<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(bytes)?;
        self.written += n as u64;
        self.hand_over_full_windows()?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn write_behind_unsupported(err: &std::io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EINVAL | libc::ESPIPE | libc::ENOSYS | libc::EOPNOTSUPP)
    )
}

/// `sync_file_range(2)` over `[offset, offset + length)`: start writing
/// those pages back, or (`wait`) also wait for them, and for any writeback
/// of them already under way, to end. rustix does not wrap it.
fn sync_file_range(
    file: &impl std::os::fd::AsFd,
    offset: u64,
    length: u64,
    wait: bool,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let flags = if wait {
        libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER
    } else {
        libc::SYNC_FILE_RANGE_WRITE
    };
    let (Ok(offset), Ok(length)) = (i64::try_from(offset), i64::try_from(length)) else {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    };
    let fd = file.as_fd().as_raw_fd();
    loop {
        // SAFETY: a plain system call on a descriptor `file` keeps open
        // for the call's duration; no memory is passed.
        #[allow(unsafe_code)]
        let result = unsafe { libc::sync_file_range(fd, offset, length, flags) };
        if result == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        // Retried here: an `Interrupted` out of `write` would make
        // `write_all` write the same bytes again.
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// How much of a file's end [`read_lossy`] reads.
pub const READ_TAIL_BYTES: u64 = 64 * 1024;

/// The last [`READ_TAIL_BYTES`] of the file as text (invalid UTF-8
/// replaced); empty when it cannot be read (a log the runtime never
/// wrote). Only the end: the init's status and log files are its stdout
/// and stderr, which the sandbox can reach (`/proc/1/fd/1`) and make as
/// large as it likes, sparse or not, and every line read is at the end.
pub fn read_lossy(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let read_tail = || -> std::io::Result<Vec<u8>> {
        let mut file = std::fs::File::open(path)?;
        let length = file.metadata()?.len();
        file.seek(SeekFrom::Start(length.saturating_sub(READ_TAIL_BYTES)))?;
        let mut bytes = Vec::new();
        file.take(READ_TAIL_BYTES).read_to_end(&mut bytes)?;
        Ok(bytes)
    };
    read_tail()
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// Runs blocking host work (host tools, directory trees) off the async
/// workers. A panic in `work` is an [`Error::Io`] `action` on `path`.
pub async fn blocking<T: Send + 'static>(
    action: &'static str,
    path: &Path,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        Err(join) => Err(Error::io(
            action,
            path,
            std::io::Error::other(join.to_string()),
        )),
    }
}

/// A `/proc/self/mountinfo` field unescaped: mountinfo writes space, tab,
/// newline and backslash as octal.
pub fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(value) = u8::try_from(value) {
                    out.push(value);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every mount point at or beneath `dir` (a canonical path), from
/// `/proc/self/mountinfo`.
pub fn mounts_beneath(dir: &Path) -> Result<Vec<PathBuf>> {
    let path = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
    Ok(text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mountinfo(field)))
        .filter(|mount| mount.starts_with(dir))
        .collect())
}

/// Removes the tree at `path` (a file, a symlink or a directory with all
/// it holds; nothing there is not an error), never following a symlink,
/// and refused while a filesystem is mounted in it (whose files are not
/// the tree's: they would be emptied through the mount).
///
/// Through `rm -rf`, not `std::fs::remove_dir_all`: that recurses one
/// stack frame and one open descriptor per level, and a tree a sandbox
/// wrote (its root layer, its home) can be tens of thousands of levels
/// deep (`mkdir a; cd a` in a loop), which overflows a thread's stack and
/// aborts the whole runner, every org's sandboxes with it. `rm` walks any
/// depth in bounded memory and descriptors. (Not `--one-file-system`:
/// btrfs subvolumes, the homes on a btrfs data dir, look like other
/// filesystems to it.)
pub fn remove_tree(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("inspect", path, e)),
        Ok(metadata) if !metadata.is_dir() => {
            return match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(Error::io("remove", path, e))
                }
                _ => Ok(()),
            };
        }
        Ok(_) => {}
    }
    let canonical = std::fs::canonicalize(path).map_err(|e| Error::io("resolve", path, e))?;
    if let Some(mount) = mounts_beneath(&canonical)?.first() {
        return Err(Error::io(
            "remove",
            path,
            std::io::Error::other(format!(
                "{} is mounted inside it: unmount it first",
                mount.display()
            )),
        ));
    }
    let search_path =
        std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    let rm = find_binary(&search_path, "rm").unwrap_or_else(|| PathBuf::from("/bin/rm"));
    let args = [OsStr::new("-rf"), OsStr::new("--"), path.as_os_str()];
    run_tool(&rm, &args, None).map_err(|failure| {
        let message = format!("`{}` failed: {}", failure.command, failure.said("; "));
        Error::io("remove", path, std::io::Error::other(message))
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Audit finding: `std::fs::remove_dir_all` of a tree tens of thousands
    /// of levels deep (a sandbox's `mkdir a; cd a` loop) overflowed the
    /// stack of the thread removing it, aborting the runner. Removed here
    /// on a thread with a small stack.
    #[test]
    fn a_tree_deeper_than_any_stack_is_removed() {
        use rustix::fs::{Mode, OFlags};
        let scratch = tempfile::tempdir().expect("tempdir");
        let top = scratch.path().join("deep");
        std::fs::create_dir(&top).expect("top");
        let mut dir = rustix::fs::open(&top, OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .expect("open");
        for _ in 0..30_000 {
            rustix::fs::mkdirat(&dir, "a", Mode::from_raw_mode(0o755)).expect("mkdir");
            dir = rustix::fs::openat(
                &dir,
                "a",
                OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .expect("open");
        }
        std::fs::write(scratch.path().join("beside"), "kept").expect("write");
        drop(dir);
        let removing = top.clone();
        let removed = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || remove_tree(&removing))
            .expect("a thread")
            .join()
            .expect("no overflow");
        removed.expect("removed");
        assert!(!top.exists());
        assert!(scratch.path().join("beside").exists(), "only the tree went");
        remove_tree(&top).expect("nothing there is not an error");
    }

    fn pattern(length: usize, seed: u8) -> Vec<u8> {
        (0..length)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    #[test]
    fn write_behind_hands_full_windows_to_the_disk_and_keeps_every_byte() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("big");
        let window = WRITE_BEHIND_WINDOW as usize;
        // Six and a half windows, in uneven pieces.
        let bytes = pattern(6 * window + window / 2, 7);
        let mut out = WriteBehind::new(File::create(&path).expect("create"), 0);
        for piece in bytes.chunks(1_000_003) {
            out.write_all(piece).expect("write");
        }
        // Every full window was handed over; the oldest were waited for.
        assert_eq!(out.next_window, 6 * WRITE_BEHIND_WINDOW);
        assert!(!out.unsupported);
        assert_eq!(out.in_flight.len(), WRITE_BEHIND_IN_FLIGHT);
        assert_eq!(out.in_flight.front(), Some(&(2 * WRITE_BEHIND_WINDOW)));
        out.into_inner().sync_all().expect("fsync");
        assert!(std::fs::read(&path).expect("read") == bytes);
    }

    #[test]
    fn write_behind_of_an_appended_file_counts_from_its_length() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("resumed");
        let window = WRITE_BEHIND_WINDOW as usize;
        let head = pattern(window / 2 + 3, 1);
        std::fs::write(&path, &head).expect("write the head");
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        let mut out = WriteBehind::new(file, head.len() as u64);
        let tail = pattern(2 * window, 2);
        out.write_all(&tail).expect("write");
        // The windows are the file's: [0, 8 MiB) and [8, 16 MiB) are full.
        assert_eq!(out.next_window, 2 * WRITE_BEHIND_WINDOW);
        assert_eq!(out.in_flight.len(), 2);
        out.into_inner().sync_all().expect("fsync");
        let mut whole = head;
        whole.extend_from_slice(&tail);
        assert!(std::fs::read(&path).expect("read") == whole);
    }

    #[test]
    fn write_behind_to_a_pipe_just_writes() {
        let (reader, writer) = std::io::pipe().expect("pipe");
        let reading = std::thread::spawn(move || {
            let mut all = Vec::new();
            std::io::Read::read_to_end(&mut { reader }, &mut all).expect("read");
            all
        });
        let bytes = pattern(2 * WRITE_BEHIND_WINDOW as usize, 3);
        let mut out = WriteBehind::new(writer, 0);
        out.write_all(&bytes).expect("write");
        assert!(out.unsupported, "a pipe has no writeback");
        drop(out);
        assert!(reading.join().expect("reader") == bytes);
    }

    #[test]
    fn tools_say_what_failed() {
        let out = run_tool("sh", &["-c", "cat"], Some("in\n")).expect("cat runs");
        assert_eq!(out, "in\n");
        let failure = run_tool(
            "sh",
            &["-c", "echo ' a ' >&2; echo >&2; echo b >&2; exit 3"],
            None,
        )
        .expect_err("exit 3");
        assert_eq!(failure.said("; "), "a; b");
        assert!(failure.command.starts_with("sh -c "), "{}", failure.command);
        assert!(matches!(
            failure.kind,
            ToolFailureKind::Exited {
                status: Some(3),
                ..
            }
        ));
        let missing = run_tool("/nonexistent/tool", &[] as &[&str], None).expect_err("missing");
        assert!(matches!(
            missing.kind,
            ToolFailureKind::Run {
                step: ToolStep::Start,
                ..
            }
        ));
        assert_eq!(missing.said("; "), "");
    }

    #[test]
    fn durable_and_atomic_writes_replace() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("f.json");
        write_file(&path, b"one").expect("write");
        write_durably(&path, b"two").expect("write durably");
        assert_eq!(read_lossy(&path), "two");
        assert!(!dir.path().join("f.tmp").exists());
        assert_eq!(read_lossy(&dir.path().join("absent")), "");
    }

    #[test]
    fn read_lossy_reads_only_the_end_of_a_huge_sparse_file() {
        use std::io::Write;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("init.status");
        let mut file = std::fs::File::create(&path).expect("create");
        // What a sandbox can make of its init's stdout: a terabyte of
        // nothing, then a status line.
        file.set_len(1 << 40).expect("sparse length");
        std::io::Seek::seek(&mut file, std::io::SeekFrom::End(0)).expect("seek");
        file.write_all(b"roost-init: stopped signal=15\n")
            .expect("write");
        let text = read_lossy(&path);
        assert_eq!(text.len() as u64, READ_TAIL_BYTES);
        assert!(
            text.ends_with("roost-init: stopped signal=15\n"),
            "{text:?}"
        );
    }

    #[test]
    fn escaped_mount_points() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/end\\04"), "/end\\04");
    }
}
