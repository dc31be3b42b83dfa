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

    /// [`Backend::put`] of a buffer the caller gives up (a built pack): a
    /// backend that would copy the bytes into a request body of its own
    /// (S3) takes this one instead, so a pack is never held twice.
    fn put_owned(&self, key: &str, data: Vec<u8>) -> Result<()> {
        self.put(key, &data)
    }

    /// [`Backend::put_owned`], durable once it returns: how a pack's data
    /// is written before its index is. An index is what tells a later push
    /// that the pack's objects are stored (it uploads none of them again),
    /// so a crash must never leave an index naming bytes that were lost.
    /// The default puts, then [`Backend::sync`]s; a local directory
    /// fsyncs the one file instead.
    fn put_owned_durable(&self, key: &str, data: Vec<u8>) -> Result<()> {
        self.put_owned(key, data)?;
        self.sync()
    }

    /// Stores several objects, as [`Backend::put`] would, in the order
    /// given: an object is stored only after every one before it, so a
    /// caller may place a tree after the children it names. A failure
    /// leaves some prefix of `objects` stored. The default is one `put`
    /// each; a backend with a costly round trip may send several per
    /// request.
    fn put_batch(&self, objects: &[(String, &[u8])]) -> Result<()> {
        for (key, data) in objects {
            self.put(key, data)?;
        }
        Ok(())
    }

    /// Replaces the small mutable object at `key` durably and atomically.
    fn put_durable(&self, key: &str, data: &[u8]) -> Result<()>;

    /// Makes every earlier `put` durable.
    fn sync(&self) -> Result<()>;

    /// `Ok(None)` only when the object does not exist; any other failure is
    /// an error, never "absent".
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Several objects, each as [`Backend::get`] returns it, in the order
    /// of `keys`. The default is one `get` each; S3 sends several at once
    /// (the block service's fetch hands out batches).
    fn get_batch(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>> {
        keys.iter().map(|key| self.get(key)).collect()
    }

    /// Whether a request costs a round trip (S3), so that reading many
    /// objects (a pack's neighbours) in one ranged read and writing larger
    /// packs pay: what a [`crate::Store`] over it answers for
    /// [`crate::Objects::reads_in_batches`], which steers pull. A local
    /// directory does not (pull's parallel reads of single objects, each a
    /// positioned read of an open pack, are faster there); the tests'
    /// wrapper says so to drive pull's batched path.
    fn reads_in_batches(&self) -> bool {
        false
    }

    /// Bytes `offset .. offset + len` of the object at `key`: fewer when
    /// the object ends sooner (the caller, which knows how long it should
    /// be, says what is wrong), `None` when it does not exist. Packs are
    /// read this way: many objects of one pack in one read.
    fn get_range(&self, key: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        Ok(self.get(key)?.map(|bytes| {
            let start = usize::try_from(offset).map_or(bytes.len(), |o| o.min(bytes.len()));
            let end = usize::try_from(offset.saturating_add(len))
                .map_or(bytes.len(), |e| e.min(bytes.len()));
            bytes[start..end].to_vec()
        }))
    }

    /// [`Backend::get_range`] handed to `each` a piece at a time as it
    /// arrives, so a long read is never held whole: a fresh pull writes a
    /// pack's first files while the rest is on its way. `Ok(false)`: the
    /// object does not exist (`each` was not called). Pieces together are
    /// what `get_range` would answer; the default reads the range whole.
    fn get_range_each(
        &self,
        key: &str,
        offset: u64,
        len: u64,
        each: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<bool> {
        match self.get_range(key, offset, len)? {
            Some(bytes) => each(&bytes).map(|()| true),
            None => Ok(false),
        }
    }

    /// Several ranges `(key, offset, len)`, each as [`Backend::get_range`]
    /// answers it, in order. The default reads one after another; S3 sends
    /// several at once.
    fn get_ranges(&self, ranges: &[(String, u64, u64)]) -> Result<Vec<Option<Vec<u8>>>> {
        ranges
            .iter()
            .map(|(key, offset, len)| self.get_range(key, *offset, *len))
            .collect()
    }

    /// Whether any object's key starts with `prefix` (which ends in `/`).
    /// Errors are errors, never `false`.
    fn any_under(&self, prefix: &str) -> Result<bool> {
        Ok(!self.list(prefix)?.is_empty())
    }

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
/// `memory:` (tests only: a fresh, empty in-process store). A local
/// store's directory is made if absent (for writers).
pub fn open(url: &str) -> Result<Arc<dyn Backend>> {
    open_with(url, true)
}

/// [`open`] for readers: a local store must exist already
/// ([`Error::NoStore`] otherwise, and nothing is made).
pub fn open_existing(url: &str) -> Result<Arc<dyn Backend>> {
    open_with(url, false)
}

fn open_with(url: &str, create: bool) -> Result<Arc<dyn Backend>> {
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
    if create {
        Ok(Arc::new(LocalBackend::open(path)?))
    } else {
        Ok(Arc::new(LocalBackend::open_existing(path)?))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// Records each `put` and fails the one at `fail_at` (0-based).
    struct Recording {
        inner: MemoryBackend,
        puts: Mutex<Vec<String>>,
        fail_at: usize,
    }

    impl Backend for Recording {
        fn put(&self, key: &str, data: &[u8]) -> Result<()> {
            let mut puts = self.puts.lock().unwrap_or_else(|p| p.into_inner());
            if puts.len() == self.fail_at {
                return Err(Error::Backend {
                    op: "put",
                    key: key.to_owned(),
                    message: "injected".to_owned(),
                });
            }
            puts.push(key.to_owned());
            self.inner.put(key, data)
        }
        fn put_durable(&self, key: &str, data: &[u8]) -> Result<()> {
            self.inner.put_durable(key, data)
        }
        fn sync(&self) -> Result<()> {
            self.inner.sync()
        }
        fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
            self.inner.get(key)
        }
        fn exists(&self, keys: &[String]) -> Result<Vec<bool>> {
            self.inner.exists(keys)
        }
        fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
            self.inner.list(prefix)
        }
        fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
            self.inner.head(key)
        }
        fn delete(&self, key: &str) -> Result<()> {
            self.inner.delete(key)
        }
    }

    #[test]
    fn the_default_batch_is_one_put_each_in_order_and_stops_at_a_failure() {
        let keys: Vec<String> = (0..5).map(|i| format!("k/{i}")).collect();
        let batch: Vec<(String, &[u8])> = keys.iter().map(|k| (k.clone(), &b"x"[..])).collect();
        for fail_at in [usize::MAX, 0, 3] {
            let backend = Recording {
                inner: MemoryBackend::default(),
                puts: Mutex::new(Vec::new()),
                fail_at,
            };
            let stored = backend.put_batch(&batch);
            let expected = &keys[..fail_at.min(keys.len())];
            assert_eq!(stored.is_ok(), fail_at == usize::MAX);
            assert_eq!(
                *backend.puts.lock().unwrap_or_else(|p| p.into_inner()),
                expected
            );
            let present = backend.exists(&keys).expect("exists");
            let prefix: Vec<bool> = (0..keys.len()).map(|i| i < expected.len()).collect();
            assert_eq!(present, prefix, "a failed batch leaves a prefix stored");
        }
    }
}
