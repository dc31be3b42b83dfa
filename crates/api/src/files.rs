//! A sandbox's files (`/v1/sandboxes/{id}/files`): read, written, listed,
//! removed, moved and made by the sandbox's own agent, inside its mount
//! namespace, through the data path (DESIGN.md §1, §3).
//!
//! Paths are the sandbox's: absolute (its own `/` is the root) or relative
//! to `/workspace`. Modes are octal strings (`"0644"`; setuid, setgid and
//! sticky show as a fourth leading digit and are never set by a write).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The longest path a request may name, in bytes (the agent's bound).
pub const PATH_BYTES_MAX: usize = 4096;
/// The deepest listing.
pub const LIST_DEPTH_MAX: u32 = 16;
/// The most entries a listing answers; past them it says `truncated`.
pub const LIST_ENTRIES_MAX: usize = 10_000;
/// A mode a request sets: 3 octal digits, or 4 with a leading 0.
pub const MODE_PATTERN: &str = r"^0?[0-7]{3}$";
/// A request's path, as far as a pattern can say (`..` components are
/// refused too, see [`check_path`]).
pub const PATH_PATTERN: &str = r"^[^\x00]{1,4096}$";

/// The data path's operations on files: the `op` of a data token
/// (`crate::data_path::DataClaims`).
pub mod ops {
    pub const READ: &str = "files.read";
    pub const WRITE: &str = "files.write";
    pub const LIST: &str = "files.list";
    pub const REMOVE: &str = "files.remove";
    pub const MOVE: &str = "files.move";
    pub const MKDIR: &str = "files.mkdir";
    pub const TAR_READ: &str = "files.tar_read";
    pub const TAR_WRITE: &str = "files.tar_write";
}

/// Headers of a file download besides the standard ones.
pub mod headers {
    /// The file's permission bits, octal (`0644`).
    pub const MODE: &str = "x-roost-mode";
    /// The whole file's size in bytes (a range's `Content-Length` is the
    /// part's).
    pub const SIZE: &str = "x-roost-size";
}

/// What a directory entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    File,
    Directory,
    Symlink,
    /// A fifo, socket or device node.
    Other,
}

impl FileType {
    pub fn as_str(self) -> &'static str {
        match self {
            FileType::File => "file",
            FileType::Directory => "directory",
            FileType::Symlink => "symlink",
            FileType::Other => "other",
        }
    }
}

/// One entry of a listing (`lstat`: a symlink is itself, never followed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FileEntry {
    /// Absolute, in the sandbox.
    pub path: String,
    #[serde(rename = "type")]
    pub kind: FileType,
    /// Bytes (a symlink's: its target's length).
    pub size: u64,
    /// Permission bits, octal.
    #[schema(pattern = r"^[0-7]{4}$")]
    pub mode: String,
    /// The last modification, RFC 3339 (UTC, milliseconds).
    pub modified_at: String,
    /// A symlink's target, as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
}

/// `GET /v1/sandboxes/{id}/files/list`: entries sorted by path.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FileList {
    pub entries: Vec<FileEntry>,
    /// More entries exist than a listing answers (10,000).
    pub truncated: bool,
}

/// `PUT /v1/sandboxes/{id}/files`: the file now in place.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FileWritten {
    /// As asked.
    pub path: String,
    /// Bytes written (the body's length).
    pub size: u64,
}

/// `DELETE /v1/sandboxes/{id}/files`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FileRemoved {
    pub path: String,
}

/// `POST /v1/sandboxes/{id}/files/move`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    #[schema(pattern = r"^[^\x00]{1,4096}$")]
    pub from: String,
    #[schema(pattern = r"^[^\x00]{1,4096}$")]
    pub to: String,
    /// Replace an existing `to` (a file, or an empty directory); without
    /// it an existing `to` is 409.
    #[serde(default)]
    pub overwrite: bool,
}

/// The answer to a move.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FileMoved {
    pub from: String,
    pub to: String,
}

/// `POST /v1/sandboxes/{id}/files/mkdir`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    #[schema(pattern = r"^[^\x00]{1,4096}$")]
    pub path: String,
    /// Make missing parents too (then an existing directory is no error).
    #[serde(default)]
    pub parents: bool,
    /// Permission bits, octal (default `0755`).
    #[serde(default)]
    #[schema(pattern = r"^0?[0-7]{3}$")]
    pub mode: Option<String>,
}

/// The answer to a mkdir.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DirectoryMade {
    pub path: String,
    /// Whether it was made now (false: it existed, with `parents`).
    pub created: bool,
}

/// What a tar stream moved, either way (`PUT …/files/tar`'s answer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
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

/// Refuses what no sandbox path may be (the agent's own rule, checked
/// before a stream starts): empty, over [`PATH_BYTES_MAX`] bytes, a NUL
/// byte, a `..` component. The message names the path.
pub fn check_path(path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Err("the path is empty".to_owned());
    }
    if path.len() > PATH_BYTES_MAX {
        return Err(format!(
            "the path is {} bytes, past the bound of {PATH_BYTES_MAX}",
            path.len()
        ));
    }
    if path.contains('\0') {
        return Err(format!("the path {:?} holds a NUL byte", shown(path)));
    }
    if path.split('/').any(|component| component == "..") {
        return Err(format!("the path {:?} has a `..` component", shown(path)));
    }
    Ok(())
}

/// A path for a message, cut short.
fn shown(path: &str) -> String {
    const SHOWN_CHARS_MAX: usize = 200;
    path.chars().take(SHOWN_CHARS_MAX).collect()
}

/// Permission bits from their octal text (3 or 4 digits): setuid, setgid
/// and sticky are refused (a write never sets them).
pub fn parse_mode(text: &str) -> Result<u32, String> {
    let valid = (3..=4).contains(&text.len()) && text.bytes().all(|b| (b'0'..=b'7').contains(&b));
    let mode = u32::from_str_radix(text, 8)
        .ok()
        .filter(|_| valid)
        .ok_or_else(|| format!("mode {text:?} is not 3 or 4 octal digits (e.g. 0644)"))?;
    if mode > 0o777 {
        return Err(format!(
            "mode {text:?} sets setuid, setgid or sticky, which a write never does"
        ));
    }
    Ok(mode)
}

/// Permission bits as the API shows them: 4 octal digits.
pub fn format_mode(mode: u32) -> String {
    format!("{:04o}", mode & 0o7777)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_modes_are_checked_as_the_agent_does() {
        for bad in ["", "a/../b", "..", "/x/..", "a\0b"] {
            assert!(check_path(bad).is_err(), "{bad:?}");
        }
        assert!(check_path(&"x".repeat(PATH_BYTES_MAX + 1)).is_err());
        for good in ["/", "a", "/workspace/x..y", "./a", "/etc/..x"] {
            assert_eq!(check_path(good), Ok(()), "{good:?}");
        }
        assert_eq!(parse_mode("0644"), Ok(0o644));
        assert_eq!(parse_mode("755"), Ok(0o755));
        for bad in ["", "8", "0x12", "12345", "4755", "+644", "64"] {
            assert!(parse_mode(bad).is_err(), "{bad:?}");
        }
        assert_eq!(format_mode(0o644), "0644");
        assert_eq!(format_mode(0o104_755), "4755");
    }
}
