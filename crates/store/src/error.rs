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

    #[error("store unreachable during {op} of {key}: {message}")]
    Backend {
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

    #[error("hash mismatch for object {digest}{}", at_path(.path))]
    Corrupt {
        digest: Digest,
        path: Option<PathBuf>,
    },

    #[error("malformed home pointer {key}")]
    MalformedPointer { key: String },

    #[error("malformed tree object {digest}: {reason}")]
    MalformedTree { digest: Digest, reason: String },

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

impl Error {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
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
            Error::Corrupt { digest, path: None } => Error::Corrupt {
                digest,
                path: Some(at.to_owned()),
            },
            Error::MissingObject { digest, path: None } => Error::MissingObject {
                digest,
                path: Some(at.to_owned()),
            },
            other => other,
        }
    }
}
