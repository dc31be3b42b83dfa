//! Object storage behind one small, synchronous trait.
//!
//! Backends store opaque bytes under `/`-separated keys. They know nothing
//! about orgs or digests; [`crate::Store`] builds every key, so the org
//! prefix cannot be forgotten. Local directory, S3 and memory backends all
//! pass the same conformance suite (`tests/it/backend.rs`).

mod local;
mod memory;
mod s3;

use std::sync::Arc;
use std::time::SystemTime;

pub use local::LocalBackend;
pub use memory::MemoryBackend;
pub use s3::S3Backend;

use crate::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: String,
    pub size: u64,
    pub last_modified: SystemTime,
}

pub trait Backend: Send + Sync {
    /// Stores `data` under `key`. Objects are write-once by convention:
    /// a second put of the same content-addressed key may overwrite it with
    /// identical bytes. Not durable until [`Backend::sync`] returns.
    fn put(&self, key: &str, data: &[u8]) -> Result<()>;

    /// Replaces the small mutable object at `key` durably and atomically.
    fn put_durable(&self, key: &str, data: &[u8]) -> Result<()>;

    /// Makes every earlier `put` durable.
    fn sync(&self) -> Result<()>;

    /// `Ok(None)` only when the object does not exist; any other failure is
    /// an error, never "absent".
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// For each key, whether it exists. Errors are errors, never `false`.
    fn exists(&self, keys: &[String]) -> Result<Vec<bool>>;

    /// Every object whose key starts with `prefix` (which ends in `/`).
    /// A listing that fails part-way is an error, never a short list.
    fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>>;

    /// Metadata of one object, `None` if absent.
    fn head(&self, key: &str) -> Result<Option<ObjectMeta>>;

    /// Deletes; deleting an absent object is not an error.
    fn delete(&self, key: &str) -> Result<()>;
}

/// Opens a store URL: a path, `file://PATH`, `s3://BUCKET/PREFIX`, or
/// `memory:` (tests only: a fresh, empty in-process store).
pub fn open(url: &str) -> Result<Arc<dyn Backend>> {
    if let Some(rest) = url.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(Error::InvalidUrl {
                url: url.to_owned(),
                reason: "missing bucket name".to_owned(),
            });
        }
        return Ok(Arc::new(S3Backend::open(bucket, prefix)?));
    }
    if url == "memory:" {
        return Ok(Arc::new(MemoryBackend::default()));
    }
    let path = url.strip_prefix("file://").unwrap_or(url);
    if path.is_empty() || url.contains("://") && !url.starts_with("file://") {
        return Err(Error::InvalidUrl {
            url: url.to_owned(),
            reason: "expected a path, file://PATH or s3://BUCKET/PREFIX".to_owned(),
        });
    }
    Ok(Arc::new(LocalBackend::open(path)?))
}
