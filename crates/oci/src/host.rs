//! Host helpers every part of the OCI layer shares: finding a binary, the
//! one runner of host tools (`ip`, `iptables`, `btrfs`, `mount`, `ld.so`…),
//! file writes that replace atomically or durably, directory sync, the
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
    let program = program.as_ref();
    let command = std::iter::once(program)
        .chain(args.iter().map(AsRef::as_ref))
        .map(OsStr::to_string_lossy)
        .collect::<Vec<_>>()
        .join(" ");
    let failed = |step: ToolStep, source: std::io::Error| ToolFailure {
        command: command.clone(),
        kind: ToolFailureKind::Run { step, source },
    };
    let mut child = Command::new(program)
        .args(args)
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
        command,
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

/// The file's contents as text (invalid UTF-8 replaced); empty when it
/// cannot be read (a log the runtime never wrote).
pub fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn escaped_mount_points() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/end\\04"), "/end\\04");
    }
}
