//! The store's error type. Variants are what callers act on; messages name
//! the object or path involved, in lowercase, on one line.

use std::path::PathBuf;

use crate::Digest;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "invalid {kind} name {name:?}: use 1-64 of a-z 0-9 - _, starting with a letter or digit"
    )]
    InvalidName { kind: &'static str, name: String },

    #[error("invalid store url {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },

    /// A local store opened for reading where there is none (a
    /// mistyped path): nothing was created.
    #[error("no store at {path}", path = .path.display())]
    NoStore { path: PathBuf },

    #[error("store unreachable during {op} of {key}: {message}")]
    Backend {
        op: &'static str,
        key: String,
        message: String,
    },

    /// The store (the block service, answering 507) has no space left, or
    /// the org is past its bound on it (429 `quota_exceeded`, `message`
    /// says which); nothing of the request was stored.
    #[error("store full during {op} of {key}: {message}")]
    StoreFull {
        op: &'static str,
        key: String,
        message: String,
    },

    #[error("no such home: {org}/{home}")]
    NoSuchHome { org: String, home: String },

    #[error("object {digest} is missing from the store{}", at_path(.path))]
    MissingObject {
        digest: Digest,
        path: Option<PathBuf>,
    },

    #[error("{reason} for object {digest}{}", at_path(.path))]
    Corrupt {
        digest: Digest,
        path: Option<PathBuf>,
        reason: Corruption,
    },

    #[error("malformed home pointer {key}")]
    MalformedPointer { key: String },

    #[error("malformed tree object {digest}: {reason}")]
    MalformedTree { digest: Digest, reason: String },

    /// A directory nested deeper than [`crate::tree::DEPTH_MAX`] below the
    /// root, found where a tree is built (scan) or read (pull).
    #[error(
        "tree too deep at {path}: more than {depth_max} nested directories",
        path = .path.display()
    )]
    TooDeep { path: PathBuf, depth_max: usize },

    /// A tree whose expansion (every entry under every directory, shared
    /// subtrees counted each time they appear) passes
    /// [`crate::tree::EXPANDED_ENTRIES_MAX`]. `what` names the tree or the
    /// directory.
    #[error("{what} expands to more than {entries_max} entries")]
    TooManyEntries { what: String, entries_max: u64 },

    /// A tree whose files, summed over its expansion, hold more than
    /// [`crate::tree::EXPANDED_FILE_BYTES_MAX`] bytes.
    #[error("{what} expands to more than {file_bytes_max} bytes of files")]
    TooManyFileBytes { what: String, file_bytes_max: u64 },

    /// A tree whose files, summed over its expansion, reference more than
    /// [`crate::tree::EXPANDED_BLOCK_REFS_MAX`] blocks.
    #[error("{what} expands to more than {block_refs_max} block references")]
    TooManyBlockRefs { what: String, block_refs_max: u64 },

    /// A tree whose distinct trees encode to more than
    /// [`crate::tree::DISTINCT_TREE_BYTES_MAX`] bytes together.
    #[error(
        "{what} has more than {tree_bytes_max} bytes of directory listings (its distinct trees)"
    )]
    TooManyTreeBytes { what: String, tree_bytes_max: u64 },

    /// A file larger than [`crate::tree::FILE_BYTES_MAX`], refused by scan
    /// before a byte of it is read.
    #[error(
        "file {path} is {size} bytes, more than the {size_max} a home may hold in one file: exclude it or make it smaller",
        path = .path.display()
    )]
    FileTooLarge {
        path: PathBuf,
        size: u64,
        size_max: u64,
    },

    /// A pull into an empty directory whose tree expands past what the
    /// directory's file system has free: refused before a byte is written
    /// (a hostile tree of a few KB may name terabytes).
    #[error(
        "{what} expands to {needed} {unit}, more than the {free} free where it goes ({path})",
        path = .path.display()
    )]
    NoRoom {
        what: String,
        path: PathBuf,
        unit: &'static str,
        needed: u64,
        free: u64,
    },

    /// An upload batch whose objects decompress to more than
    /// `objects::BATCH_PLAIN_BYTES_MAX` together: nothing of it stored.
    #[error(
        "the batch decompresses to more than {plain_bytes_max} bytes: send fewer objects per batch"
    )]
    BatchTooLarge { plain_bytes_max: u64 },

    #[error("{}", io_message(.source, .path))]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("file changed while it was being read: {path}; push again", path = .path.display())]
    FileChanged { path: PathBuf },

    #[error("objects this push relied on kept vanishing before commit (concurrent gc); push again")]
    CommitRaced,

    #[error(
        "tree {root} is incomplete in the store: {missing} objects missing; upload them and commit again"
    )]
    IncompleteTree { root: Digest, missing: u64 },

    #[error("store busy: gave up waiting for {waiting_for}")]
    StoreBusy { waiting_for: &'static str },

    #[error("gc aborted, nothing deleted: {0}")]
    GcAborted(Box<Error>),

    #[error("invalid exclude pattern {pattern:?}: {reason}")]
    InvalidExclude { pattern: String, reason: String },
}

fn at_path(path: &Option<PathBuf>) -> String {
    match path {
        Some(path) => format!(" at {}", path.display()),
        None => String::new(),
    }
}

fn io_message(source: &std::io::Error, path: &std::path::Path) -> String {
    match source.kind() {
        std::io::ErrorKind::PermissionDenied => format!("permission denied at {}", path.display()),
        std::io::ErrorKind::NotFound => format!("not found: {}", path.display()),
        _ => format!("{} at {}", source, path.display()),
    }
}

/// What is wrong with an object that does not decode to its digest: the
/// first check it failed, so a truncated upload says so rather than
/// "hash mismatch".
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Corruption {
    /// It decodes, to bytes with another hash.
    #[error("hash mismatch")]
    HashMismatch,
    /// It decodes to another number of bytes than its frame (or, for a
    /// file's block, its tree) says it holds.
    #[error("length mismatch (expected {expected} bytes, found {found})")]
    LengthMismatch { expected: u64, found: u64 },
    /// Its frame cannot be decoded at all (empty, an unknown frame byte, a
    /// zstd frame cut short or followed by other bytes).
    #[error("undecodable frame ({0})")]
    Frame(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }

    /// Whether the store said it has no space left or the org is past
    /// its bound on it (a block service's 507 or 429): nothing of the
    /// request was stored.
    pub fn is_store_full(&self) -> bool {
        matches!(self, Error::StoreFull { .. })
    }

    /// Whether a disk this process writes to has no space left (`ENOSPC`,
    /// `EDQUOT`): a pull's destination, its file index or block cache, or
    /// the directory of a local store.
    pub fn is_disk_full(&self) -> bool {
        match self {
            Error::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
            ),
            Error::NoRoom { .. } => true,
            _ => false,
        }
    }

    /// Whether the store, or the disk under a local one, is out of space:
    /// [`Error::is_store_full`] or [`Error::is_disk_full`]. Right where
    /// the store is a local directory (the server's store, a backup's
    /// destination); a runner pulling through the block service tells the
    /// two apart, since there a full disk is its own.
    pub fn is_out_of_space(&self) -> bool {
        self.is_store_full() || self.is_disk_full()
    }

    /// Whether running the whole push again is likely to succeed: a file
    /// changed under the scan, or gc kept taking what the push relied on.
    /// Backend errors are not: the S3 client already retried them, and a
    /// local directory's errors do not go away by themselves.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::CommitRaced | Error::FileChanged { .. })
    }

    /// Attach the home-relative path (the root, an empty path, adds nothing) of the file an object belongs to.
    pub fn at(self, at: &std::path::Path) -> Error {
        if at.as_os_str().is_empty() {
            return self;
        }
        match self {
            Error::Corrupt {
                digest,
                path: None,
                reason,
            } => Error::Corrupt {
                digest,
                path: Some(at.to_owned()),
                reason,
            },
            Error::MissingObject { digest, path: None } => Error::MissingObject {
                digest,
                path: Some(at.to_owned()),
            },
            other => other,
        }
    }
}
