//! Org-scoped access to objects and home pointers: the only place that
//! builds backend keys, so nothing one org names can resolve to another
//! org's object. `Store` is the store engine's [`Objects`]; pointers,
//! locks and listing are its own.
//!
//! Key layout:
//! - `orgs/{org}/blocks/{first two hex}/{digest hex}`: file content blocks
//! - `orgs/{org}/trees/{first two hex}/{digest hex}`: directory objects
//! - `orgs/{org}/homes/{home}`: the home's current root digest
//! - `locks/gc/{id}`, `locks/commit/{id}`: see [`Store::lock_commit`]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::backend::{self, Backend, ObjectMeta};
use crate::objects::Objects;
use crate::tree::Tree;
use crate::{Digest, Error, HomeName, OrgId, Result, block};

/// Trees and blocks live in separate namespaces so gc can tell them apart
/// without reading (it reads trees, never blocks, to order its sweep).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectKind {
    Block,
    Tree,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId {
    pub kind: ObjectKind,
    pub digest: Digest,
}

impl ObjectId {
    pub fn block(digest: Digest) -> ObjectId {
        ObjectId {
            kind: ObjectKind::Block,
            digest,
        }
    }
    pub fn tree(digest: Digest) -> ObjectId {
        ObjectId {
            kind: ObjectKind::Tree,
            digest,
        }
    }
}

/// Digests per existence request: bounds request size whatever the home
/// (4096 ids are 128 KiB binary, 256 KiB hex), while the change of a busy
/// hour (1% of a 100k-file home: ~1000 blocks, ~3000 trees) fits one.
pub const MISSING_CHECK_BATCH_MAX: usize = 4096;

/// A lock not refreshed for this long belongs to a dead process.
pub const LOCK_STALE: Duration = Duration::from_secs(120);
/// Holders refresh their lock this often (well inside [`LOCK_STALE`]).
const LOCK_REFRESH: Duration = Duration::from_secs(20);

/// How long a store lock lives unrefreshed and how often holders refresh
/// theirs. Every process sharing a store must use the same values; only
/// tests change them ([`Store::with_lock_timing`]), to race a gc whose
/// work outlasts a lock's life without waiting minutes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockTiming {
    pub stale: Duration,
    pub refresh: Duration,
}

impl Default for LockTiming {
    fn default() -> LockTiming {
        LockTiming {
            stale: LOCK_STALE,
            refresh: LOCK_REFRESH,
        }
    }
}
/// How long a commit or a gc waits for the other side before giving up.
pub const LOCK_WAIT_MAX: Duration = Duration::from_secs(600);
const LOCK_POLL: Duration = Duration::from_millis(50);
const GC_LOCKS: &str = "locks/gc/";
const COMMIT_LOCKS: &str = "locks/commit/";

pub struct Store {
    backend: Arc<dyn Backend>,
    lock_timing: LockTiming,
}

impl Store {
    pub fn new(backend: Arc<dyn Backend>) -> Store {
        Store {
            backend,
            lock_timing: LockTiming::default(),
        }
    }

    /// This store with other lock timings (tests; see [`LockTiming`]).
    pub fn with_lock_timing(self, lock_timing: LockTiming) -> Store {
        Store {
            lock_timing,
            ..self
        }
    }

    pub fn open(url: &str) -> Result<Store> {
        Ok(Store::new(backend::open(url)?))
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn orgs_prefix() -> &'static str {
        "orgs/"
    }

    pub fn object_key(org: &OrgId, object: &ObjectId) -> String {
        let hex = object.digest.to_hex();
        let kind = match object.kind {
            ObjectKind::Block => "blocks",
            ObjectKind::Tree => "trees",
        };
        format!("orgs/{org}/{kind}/{}/{hex}", &hex[..2])
    }

    pub fn home_key(org: &OrgId, home: &HomeName) -> String {
        format!("orgs/{org}/homes/{home}")
    }

    /// Compresses and stores an object; returns the stored size.
    pub fn put_object(&self, org: &OrgId, object: &ObjectId, plain: &[u8]) -> Result<u64> {
        debug_assert_eq!(Digest::of(plain), object.digest);
        let stored = block::encode(plain);
        self.backend.put(&Self::object_key(org, object), &stored)?;
        Ok(stored.len() as u64)
    }

    /// Stores an object already encoded by a client, after checking that
    /// it decodes to its digest ([`Error::Corrupt`] otherwise: nothing is
    /// stored).
    pub fn put_encoded(&self, org: &OrgId, object: &ObjectId, stored: &[u8]) -> Result<()> {
        block::decode(&object.digest, stored)?;
        self.backend.put(&Self::object_key(org, object), stored)
    }

    /// The stored (encoded) bytes of an object, unverified.
    pub fn get_encoded(&self, org: &OrgId, object: &ObjectId) -> Result<Vec<u8>> {
        self.backend
            .get(&Self::object_key(org, object))?
            .ok_or(Error::MissingObject {
                digest: object.digest,
                path: None,
            })
    }

    /// An object's plain content, verified against its digest.
    pub fn get_object(&self, org: &OrgId, object: &ObjectId) -> Result<Vec<u8>> {
        block::decode(&object.digest, &self.get_encoded(org, object)?)
    }

    pub fn get_tree(&self, org: &OrgId, digest: &Digest) -> Result<Tree> {
        Tree::decode(digest, &self.get_object(org, &ObjectId::tree(*digest))?)
    }

    pub fn read_home(&self, org: &OrgId, home: &HomeName) -> Result<Option<Digest>> {
        let key = Self::home_key(org, home);
        let Some(bytes) = self.backend.get(&key)? else {
            return Ok(None);
        };
        let text = std::str::from_utf8(&bytes)
            .map_err(|_| Error::MalformedPointer { key: key.clone() })?;
        let digest = text
            .trim()
            .parse()
            .map_err(|_| Error::MalformedPointer { key })?;
        Ok(Some(digest))
    }

    /// Durably points the home at `root`. Callers write this last, after
    /// [`Store::sync`], so a pointer only ever names a complete tree.
    pub fn write_home(&self, org: &OrgId, home: &HomeName, root: &Digest) -> Result<()> {
        self.backend
            .put_durable(&Self::home_key(org, home), format!("{root}\n").as_bytes())
    }

    /// Removes the home's pointer; its objects become collectable by gc.
    pub fn delete_home(&self, org: &OrgId, home: &HomeName) -> Result<()> {
        self.backend.delete(&Self::home_key(org, home))
    }

    pub fn sync(&self) -> Result<()> {
        self.backend.sync()
    }

    /// Takes the store's commit lock: held from a push's final existence
    /// check to its pointer write. While any push holds it no gc sweeps, and
    /// while a gc sweeps no push commits; so what a push checked just before
    /// committing is still there when its pointer lands, and a gc sees every
    /// pointer committed before its listing.
    ///
    /// Both sides write their own lock first and then look for the other's
    /// (a store that reads its own writes, as S3 and a local directory do,
    /// makes at least one of them see the other). A waiting push removes its
    /// lock so a gc is never starved of its turn.
    pub fn lock_commit(&self) -> Result<StoreLock<'_>> {
        let started = Instant::now();
        loop {
            let lock = StoreLock::take(self, COMMIT_LOCKS)?;
            if !self.any_live_lock(GC_LOCKS)? {
                return Ok(lock);
            }
            drop(lock);
            if started.elapsed() > LOCK_WAIT_MAX {
                return Err(Error::StoreBusy {
                    waiting_for: "a running gc",
                });
            }
            std::thread::sleep(LOCK_POLL);
        }
    }

    /// Takes the gc lock and waits until no push is between its final check
    /// and its commit. See [`Store::lock_commit`].
    pub fn lock_gc(&self) -> Result<StoreLock<'_>> {
        let started = Instant::now();
        let lock = StoreLock::take(self, GC_LOCKS)?;
        while self.any_live_lock(COMMIT_LOCKS)? {
            if started.elapsed() > LOCK_WAIT_MAX {
                return Err(Error::StoreBusy {
                    waiting_for: "pushes committing",
                });
            }
            lock.refresh_if_due()?;
            std::thread::sleep(LOCK_POLL);
        }
        Ok(lock)
    }

    fn any_live_lock(&self, prefix: &str) -> Result<bool> {
        let now = SystemTime::now();
        Ok(self.backend.list(prefix)?.iter().any(|lock| {
            now.duration_since(lock.last_modified)
                .map_or(true, |age| age < self.lock_timing.stale)
        }))
    }

    /// Every object and pointer of every org.
    pub fn list_all(&self) -> Result<Vec<ObjectMeta>> {
        self.backend.list(Self::orgs_prefix())
    }
}

/// The store engine's objects: keys built here, existence asked in
/// bounded batches, stored and read through the backend as they are.
impl Objects for Store {
    fn missing(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<ObjectId>> {
        let mut missing = Vec::new();
        for batch in objects.chunks(MISSING_CHECK_BATCH_MAX) {
            let keys: Vec<String> = batch.iter().map(|o| Self::object_key(org, o)).collect();
            let present = self.backend.exists(&keys)?;
            missing.extend(
                batch
                    .iter()
                    .zip(present)
                    .filter(|(_, present)| !present)
                    .map(|(d, _)| *d),
            );
        }
        Ok(missing)
    }

    /// Stores the bytes as given ([`Backend::put_batch`]), without decoding
    /// them again: for bytes this process encoded itself or has just
    /// verified ([`crate::objects::put_batch_checked`]).
    fn put_batch(&self, org: &OrgId, objects: &[(ObjectId, &[u8])]) -> Result<()> {
        let batch: Vec<(String, &[u8])> = objects
            .iter()
            .map(|(object, stored)| (Self::object_key(org, object), *stored))
            .collect();
        self.backend.put_batch(&batch)
    }

    fn get(&self, org: &OrgId, object: &ObjectId) -> Result<Option<Vec<u8>>> {
        self.backend.get(&Self::object_key(org, object))
    }

    fn get_batch(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<Option<Vec<u8>>>> {
        let keys: Vec<String> = objects.iter().map(|o| Self::object_key(org, o)).collect();
        let fetched = self.backend.get_batch(&keys)?;
        if fetched.len() != objects.len() {
            return Err(Error::Backend {
                op: "get",
                key: keys.first().cloned().unwrap_or_default(),
                message: format!("{} objects for {} asked", fetched.len(), objects.len()),
            });
        }
        Ok(fetched)
    }

    fn reads_in_batches(&self) -> bool {
        self.backend.reads_in_batches()
    }
}

/// A held store lock; refreshed by [`StoreLock::refresh_if_due`] during
/// long work, removed on drop (or ignored once stale if we die).
pub struct StoreLock<'a> {
    store: &'a Store,
    key: String,
    refreshed_at: Mutex<Instant>,
}

impl<'a> StoreLock<'a> {
    fn take(store: &'a Store, prefix: &str) -> Result<StoreLock<'a>> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let key = format!(
            "{prefix}{nanos}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        store.backend.put_durable(&key, b"")?;
        Ok(StoreLock {
            store,
            key,
            refreshed_at: Mutex::new(Instant::now()),
        })
    }

    pub fn refresh_if_due(&self) -> Result<()> {
        let mut refreshed_at = self.refreshed_at.lock().unwrap_or_else(|p| p.into_inner());
        if refreshed_at.elapsed() >= self.store.lock_timing.refresh {
            self.store.backend.put_durable(&self.key, b"")?;
            *refreshed_at = Instant::now();
        }
        Ok(())
    }
}

impl Drop for StoreLock<'_> {
    fn drop(&mut self) {
        if let Err(err) = self.store.backend.delete(&self.key) {
            tracing::warn!(%err, key = %self.key, "could not remove a store lock; it goes stale");
        }
    }
}

/// What a backend key under `orgs/` names.
#[derive(Debug, PartialEq, Eq)]
pub enum KeyKind {
    Object { org: OrgId, object: ObjectId },
    Home { org: OrgId, home: HomeName },
}

/// Parses a key built by [`Store`]; foreign keys give `None` and are left alone.
pub fn parse_key(key: &str) -> Option<KeyKind> {
    let mut parts = key.strip_prefix("orgs/")?.split('/');
    let org: OrgId = parts.next()?.parse().ok()?;
    match (parts.next()?, parts.next()?, parts.next(), parts.next()) {
        (kind @ ("blocks" | "trees"), fanout, Some(hex), None) if hex.starts_with(fanout) => {
            let digest = hex.parse().ok()?;
            let object = if kind == "trees" {
                ObjectId::tree(digest)
            } else {
                ObjectId::block(digest)
            };
            Some(KeyKind::Object { org, object })
        }
        ("homes", home, None, None) => Some(KeyKind::Home {
            org,
            home: home.parse().ok()?,
        }),
        _ => None,
    }
}
