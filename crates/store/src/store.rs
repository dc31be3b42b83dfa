//! Org-scoped access to objects and home pointers: the only place that
//! builds backend keys, so nothing one org names can resolve to another
//! org's object. `Store` is the store engine's [`Objects`]; pointers,
//! locks and listing are its own.
//!
//! Key layout:
//! - `orgs/{org}/packs/{id}.pack`, `orgs/{org}/packs/{id}.idx`: packs of
//!   objects and their indexes ([`crate::pack`]), where every object is
//!   written
//! - `orgs/{org}/blocks/{first two hex}/{digest hex}`: file content blocks
//!   one per file, as stores before packs wrote them (still read, moved
//!   into packs by [`crate::gc::repack_loose`])
//! - `orgs/{org}/trees/{first two hex}/{digest hex}`: directory objects,
//!   likewise
//! - `orgs/{org}/homes/{home}`: the home's current root digest
//! - `locks/gc/{id}`, `locks/commit/{id}`: see [`Store::lock_commit`]
//!
//! The org's pack index ([`OrgPacks`]) answers "is this object here" and
//! "where" without reading packs: it is built from the packs' index files,
//! listed again before every existence answer (so a check under the commit
//! lock sees exactly what gc left), and extended by this process's own
//! writes. Memory: one hash-map entry per object (kind and digest, pack
//! slot, offset, length: about 64 bytes with the table's slack), so a
//! process holds the index of the orgs it touches; see ARCHITECTURE.md for
//! what that means at 100 million objects.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use crate::backend::{self, Backend, ObjectMeta};
use crate::objects::Objects;
use crate::pack::{PackBuilder, PackId, PackIndex};
use crate::tree::Tree;
use crate::{Corruption, Digest, Error, HomeName, OrgId, Result, block};

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

/// Bytes between two wanted objects of a pack that one ranged read still
/// spans rather than split in two: reading them costs less than another
/// open or request.
const RANGE_GAP_BYTES_MAX: u64 = 256 * 1024;
/// Most bytes one ranged read spans.
const RANGE_BYTES_MAX: u64 = 16 * 1024 * 1024;

pub struct Store {
    backend: Arc<dyn Backend>,
    lock_timing: LockTiming,
    /// Whether `put_batch` writes packs (every store) or one key per
    /// object (a runner's block cache, which fills object by object).
    packing: bool,
    packs: Mutex<HashMap<OrgId, OrgPacks>>,
    /// One listing-and-merge at a time, so an older listing is never
    /// applied over a newer one.
    refreshing: Mutex<()>,
    /// A local directory keeping copies of pack indexes read (immutable,
    /// so a copy never goes stale; each is checked like the original):
    /// a new process reads the org's index from disk, not the store.
    index_cache: Option<std::path::PathBuf>,
}

/// An org's pack index: every object of every pack index read, by name.
#[derive(Default)]
struct OrgPacks {
    /// Whether the org's packs were listed at least once.
    listed: bool,
    slots: Vec<PackId>,
    by_pack: HashMap<PackId, u32>,
    objects: HashMap<ObjectId, Located>,
    /// Indexes that lie ([`crate::pack::decode_index`]): their objects
    /// count as absent (re-uploaded; nothing is read through them).
    refused: HashSet<PackId>,
    /// Whether objects stored one per key may exist (checked once: this
    /// process's own single-object writes set it).
    loose: Option<bool>,
}

#[derive(Clone, Copy, Debug)]
struct Located {
    slot: u32,
    offset: u64,
    length: u32,
}

impl OrgPacks {
    fn add(&mut self, index: &PackIndex) {
        let slot = match self.by_pack.get(&index.pack) {
            Some(_) => return,
            None => {
                self.slots.push(index.pack);
                (self.slots.len() - 1) as u32
            }
        };
        self.by_pack.insert(index.pack, slot);
        self.objects.reserve(index.entries.len());
        for entry in &index.entries {
            self.objects.insert(
                entry.object,
                Located {
                    slot,
                    offset: entry.offset,
                    length: entry.length,
                },
            );
        }
    }

    fn locate(&self, object: &ObjectId) -> Option<Location> {
        self.objects.get(object).map(|located| Location {
            pack: self.slots[located.slot as usize],
            offset: located.offset,
            length: located.length,
        })
    }
}

/// Where a packed object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub pack: PackId,
    pub offset: u64,
    pub length: u32,
}

/// Which file of a pack a key names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackPart {
    Data,
    Index,
}

impl Store {
    pub fn new(backend: Arc<dyn Backend>) -> Store {
        Store {
            backend,
            lock_timing: LockTiming::default(),
            packing: true,
            packs: Mutex::new(HashMap::new()),
            refreshing: Mutex::new(()),
            index_cache: None,
        }
    }

    /// This store keeping copies of the pack indexes it reads under `dir`
    /// (one directory per store: the caller names it). Losing the copies
    /// costs reading the indexes from the store again; a copy that does
    /// not decode (checksum, org, pack) is read again from the store.
    pub fn with_index_cache(self, dir: std::path::PathBuf) -> Store {
        Store {
            index_cache: Some(dir),
            ..self
        }
    }

    fn cached_index_path(&self, org: &OrgId, pack: &PackId) -> Option<std::path::PathBuf> {
        self.index_cache
            .as_ref()
            .map(|dir| dir.join(org.as_str()).join(format!("{pack}.idx")))
    }

    /// An index from the local cache, if there and sound.
    fn cached_index(&self, org: &OrgId, pack: &PackId) -> Option<PackIndex> {
        let bytes = std::fs::read(self.cached_index_path(org, pack)?).ok()?;
        crate::pack::decode_index(org, pack, &bytes).ok()
    }

    /// Keeps a copy of an index read from the store; a failure only costs
    /// a later read.
    fn cache_index(&self, org: &OrgId, pack: &PackId, bytes: &[u8]) {
        let Some(path) = self.cached_index_path(org, pack) else {
            return;
        };
        let write = || -> std::io::Result<()> {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let temp = path.with_extension(format!("tmp.{}", std::process::id()));
            std::fs::write(&temp, bytes)?;
            std::fs::rename(&temp, &path)
        };
        if let Err(err) = write() {
            tracing::debug!(%err, path = %path.display(), "pack index not cached");
        }
    }

    /// Removes cached copies of indexes whose packs are gone.
    fn prune_index_cache(&self, org: &OrgId, listed: &HashSet<PackId>) {
        let Some(dir) = self.index_cache.as_ref().map(|d| d.join(org.as_str())) else {
            return;
        };
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let gone = name
                .to_str()
                .and_then(|n| n.strip_suffix(".idx"))
                .and_then(|id| id.parse::<PackId>().ok())
                .is_some_and(|pack| !listed.contains(&pack));
            if gone {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// A store that writes one key per object (a runner's block cache,
    /// filled an object at a time, where packs of one would double the
    /// files). It still reads packs.
    pub fn unpacked(backend: Arc<dyn Backend>) -> Store {
        Store {
            packing: false,
            ..Store::new(backend)
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

    pub fn packs_prefix(org: &OrgId) -> String {
        format!("orgs/{org}/packs/")
    }

    pub fn pack_key(org: &OrgId, pack: &PackId, part: PackPart) -> String {
        let extension = match part {
            PackPart::Data => "pack",
            PackPart::Index => "idx",
        };
        format!("orgs/{org}/packs/{pack}.{extension}")
    }

    /// Compresses and stores an object; returns the stored size.
    pub fn put_object(&self, org: &OrgId, object: &ObjectId, plain: &[u8]) -> Result<u64> {
        debug_assert_eq!(Digest::of(plain), object.digest);
        let stored = block::encode(plain);
        self.put_batch(org, &[(*object, &stored)])?;
        Ok(stored.len() as u64)
    }

    /// Stores an object already encoded by a client, after checking that
    /// it decodes to its digest ([`Error::Corrupt`] otherwise: nothing is
    /// stored).
    pub fn put_encoded(&self, org: &OrgId, object: &ObjectId, stored: &[u8]) -> Result<()> {
        block::decode(&object.digest, stored)?;
        self.put_batch(org, &[(*object, stored)])
    }

    /// The stored (encoded) bytes of an object, unverified, from its pack
    /// or its own key.
    pub fn get_encoded(&self, org: &OrgId, object: &ObjectId) -> Result<Vec<u8>> {
        self.get(org, object)?.ok_or(Error::MissingObject {
            digest: object.digest,
            path: None,
        })
    }

    fn packs(&self) -> MutexGuard<'_, HashMap<OrgId, OrgPacks>> {
        // Plain maps stay valid if a holder panicked.
        self.packs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lists the org's pack indexes and reads those not yet known; when a
    /// known one is gone (gc removed or rewrote its pack), builds the org's
    /// index again from those listed. Returns the packs listed.
    fn refresh_packs(&self, org: &OrgId) -> Result<()> {
        let _one_at_a_time = self.refreshing.lock().unwrap_or_else(|p| p.into_inner());
        let mut listed: Vec<PackId> = Vec::new();
        for meta in self.backend.list(&Self::packs_prefix(org))? {
            if let Some(KeyKind::Pack {
                pack,
                part: PackPart::Index,
                ..
            }) = parse_key(&meta.key)
            {
                listed.push(pack);
            }
        }
        let listed_set: HashSet<PackId> = listed.iter().copied().collect();
        let (rebuild, wanted) = {
            let packs = self.packs();
            let state = packs.get(org);
            let known = |pack: &PackId| {
                state.is_some_and(|s| s.by_pack.contains_key(pack) || s.refused.contains(pack))
            };
            let rebuild =
                state.is_some_and(|s| s.slots.iter().any(|pack| !listed_set.contains(pack)));
            let wanted: Vec<PackId> = listed
                .iter()
                .filter(|pack| rebuild || !known(pack))
                .copied()
                .collect();
            (rebuild, wanted)
        };
        let mut indexes = Vec::new();
        let mut uncached = Vec::new();
        for pack in wanted {
            match self.cached_index(org, &pack) {
                Some(index) => indexes.push(index),
                None => uncached.push(pack),
            }
        }
        if rebuild {
            self.prune_index_cache(org, &listed_set);
        }
        let keys: Vec<String> = uncached
            .iter()
            .map(|pack| Self::pack_key(org, pack, PackPart::Index))
            .collect();
        let fetched = self.backend.get_batch(&keys)?;
        let mut refused = Vec::new();
        for (pack, bytes) in uncached.iter().zip(fetched) {
            // Gone since the listing: removed by a gc, like one unlisted.
            let Some(bytes) = bytes else { continue };
            match crate::pack::decode_index(org, pack, &bytes) {
                Ok(index) => {
                    self.cache_index(org, pack, &bytes);
                    indexes.push(index);
                }
                Err(reason) => {
                    tracing::warn!(%org, %pack, %reason, "pack index refused; its objects count as absent");
                    refused.push(*pack);
                }
            }
        }
        let mut packs = self.packs();
        let state = packs.entry(org.clone()).or_default();
        if rebuild {
            let loose = state.loose;
            *state = OrgPacks {
                loose,
                ..OrgPacks::default()
            };
        }
        state.listed = true;
        state.refused.extend(refused);
        for index in &indexes {
            state.add(index);
        }
        Ok(())
    }

    /// Where a packed object is, listing the org's packs first if this
    /// process has not yet (`None`: in no pack this process knows of).
    pub fn locate(&self, org: &OrgId, object: &ObjectId) -> Result<Option<Location>> {
        if !self.packs().get(org).is_some_and(|state| state.listed) {
            self.refresh_packs(org)?;
        }
        Ok(self.packs().get(org).and_then(|state| state.locate(object)))
    }

    /// Whether the org may hold objects stored one per key.
    fn may_have_loose(&self, org: &OrgId) -> Result<bool> {
        if let Some(loose) = self.packs().get(org).and_then(|state| state.loose) {
            return Ok(loose);
        }
        let loose = self.backend.any_under(&format!("orgs/{org}/blocks/"))?
            || self.backend.any_under(&format!("orgs/{org}/trees/"))?;
        self.packs().entry(org.clone()).or_default().loose = Some(loose);
        Ok(loose)
    }

    /// Reads a packed object: `Ok(None)` if its pack is gone.
    fn read_located(
        &self,
        org: &OrgId,
        object: &ObjectId,
        at: &Location,
    ) -> Result<Option<Vec<u8>>> {
        let key = Self::pack_key(org, &at.pack, PackPart::Data);
        let Some(bytes) = self
            .backend
            .get_range(&key, at.offset, u64::from(at.length))?
        else {
            return Ok(None);
        };
        check_range_len(object, at, bytes.len())?;
        Ok(Some(bytes))
    }

    /// An object's stored bytes from its pack, listing the packs again
    /// once if it is in none known or its pack is gone.
    fn get_packed(
        &self,
        org: &OrgId,
        object: &ObjectId,
        refreshed: bool,
    ) -> Result<Option<Vec<u8>>> {
        if let Some(at) = self.locate(org, object)?
            && let Some(bytes) = self.read_located(org, object, &at)?
        {
            return Ok(Some(bytes));
        }
        if refreshed {
            return Ok(None);
        }
        self.refresh_packs(org)?;
        self.get_packed(org, object, true)
    }

    /// Writes `objects` (stored bytes) as packs of at most
    /// [`crate::pack::PACK_BYTES_MAX`], in order: each pack, then its
    /// index, so an index never names bytes not yet written, and the
    /// objects of one pack appear together. Returns the indexes written.
    /// `born`: when the objects were first stored, for objects gc moves
    /// (see [`PackIndex::born`]).
    pub fn write_packs(
        &self,
        org: &OrgId,
        objects: &[(ObjectId, &[u8])],
        born: Option<SystemTime>,
    ) -> Result<Vec<PackIndex>> {
        let mut written = Vec::new();
        // Sized for what is left (at most a pack): no buffer doubling.
        let capacity = |from: usize| {
            let left: u64 = objects[from..].iter().map(|(_, s)| s.len() as u64).sum();
            left.min(crate::pack::PACK_BYTES_MAX) as usize
        };
        let mut builder = PackBuilder::with_capacity(capacity(0));
        for (i, (object, stored)) in objects.iter().enumerate() {
            if !builder.has_room(stored.len()) {
                let full = std::mem::take(&mut builder);
                written.push(self.write_pack(org, full, born)?);
                builder = PackBuilder::with_capacity(capacity(i));
            }
            builder.push(*object, stored);
        }
        if !builder.is_empty() {
            written.push(self.write_pack(org, builder, born)?);
        }
        Ok(written)
    }

    fn write_pack(
        &self,
        org: &OrgId,
        builder: PackBuilder,
        born: Option<SystemTime>,
    ) -> Result<PackIndex> {
        let pack = PackId::random();
        let (bytes, index_bytes, index) = builder.finish(org, pack, born);
        self.backend
            .put(&Self::pack_key(org, &pack, PackPart::Data), &bytes)?;
        self.backend
            .put(&Self::pack_key(org, &pack, PackPart::Index), &index_bytes)?;
        // Known at once to this process; others find it by listing.
        self.packs().entry(org.clone()).or_default().add(&index);
        Ok(index)
    }

    /// A pack's index as stored: `Ok(None)` if absent, `Ok(Some(Err))`
    /// naming why it is refused.
    pub fn read_pack_index(
        &self,
        org: &OrgId,
        pack: &PackId,
    ) -> Result<Option<std::result::Result<PackIndex, String>>> {
        let key = Self::pack_key(org, pack, PackPart::Index);
        Ok(self
            .backend
            .get(&key)?
            .map(|bytes| crate::pack::decode_index(org, pack, &bytes)))
    }

    /// A whole pack's bytes, `None` if absent.
    pub fn read_pack(&self, org: &OrgId, pack: &PackId) -> Result<Option<Vec<u8>>> {
        self.backend.get(&Self::pack_key(org, pack, PackPart::Data))
    }

    /// A pack's index file as stored, unchecked (`None`: absent): what a
    /// copy into another store ([`crate::copy`]) checks, then writes as is.
    pub fn read_pack_index_bytes(&self, org: &OrgId, pack: &PackId) -> Result<Option<Vec<u8>>> {
        self.backend
            .get(&Self::pack_key(org, pack, PackPart::Index))
    }

    /// Writes the bytes of a pack copied whole from another store. Its
    /// index goes after, through [`Store::put_pack_index`], once these
    /// bytes are synced: until then the pack does not count as present.
    pub fn put_pack_data(&self, org: &OrgId, pack: &PackId, bytes: &[u8]) -> Result<()> {
        self.backend
            .put(&Self::pack_key(org, pack, PackPart::Data), bytes)
    }

    /// Writes a copied pack's index (its checked `index`, as `bytes`):
    /// from here on its objects are present.
    pub fn put_pack_index(&self, org: &OrgId, index: &PackIndex, bytes: &[u8]) -> Result<()> {
        self.backend
            .put(&Self::pack_key(org, &index.pack, PackPart::Index), bytes)?;
        self.packs().entry(org.clone()).or_default().add(index);
        Ok(())
    }

    /// Objects stored under their own keys (stores from before packs), as
    /// stored and unchecked, in order; `None` where absent.
    pub fn get_loose_batch(
        &self,
        org: &OrgId,
        objects: &[ObjectId],
    ) -> Result<Vec<Option<Vec<u8>>>> {
        let keys: Vec<String> = objects.iter().map(|o| Self::object_key(org, o)).collect();
        self.backend.get_batch(&keys)
    }

    /// Stores checked objects under their own keys, in order: a copy of a
    /// store from before packs keeps its layout.
    pub fn put_loose_batch(&self, org: &OrgId, objects: &[(ObjectId, &[u8])]) -> Result<()> {
        let batch: Vec<(String, &[u8])> = objects
            .iter()
            .map(|(object, stored)| (Self::object_key(org, object), *stored))
            .collect();
        self.backend.put_batch(&batch)?;
        self.packs().entry(org.clone()).or_default().loose = Some(true);
        Ok(())
    }

    /// Removes a pack: its index first (its objects vanish together), then
    /// its bytes. Only gc calls it.
    pub(crate) fn delete_pack(&self, org: &OrgId, pack: &PackId) -> Result<()> {
        self.backend
            .delete(&Self::pack_key(org, pack, PackPart::Index))?;
        self.backend
            .delete(&Self::pack_key(org, pack, PackPart::Data))
    }

    /// Removes an object stored under its own key. Only gc calls it.
    pub(crate) fn delete_loose(&self, org: &OrgId, object: &ObjectId) -> Result<()> {
        self.backend.delete(&Self::object_key(org, object))
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

/// The store engine's objects: every write a pack, every read through
/// the org's pack index first and then the object's own key (stores from
/// before packs), existence from the index listed afresh.
impl Objects for Store {
    /// Lists the org's packs first, every time: an answer of "present"
    /// then names an object in a pack that existed after this call began,
    /// which under the commit lock no gc can remove.
    fn missing(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<ObjectId>> {
        self.refresh_packs(org)?;
        let unpacked: Vec<ObjectId> = {
            let packs = self.packs();
            let state = packs.get(org);
            objects
                .iter()
                .filter(|object| !state.is_some_and(|s| s.objects.contains_key(object)))
                .copied()
                .collect()
        };
        if unpacked.is_empty() || !self.may_have_loose(org)? {
            return Ok(unpacked);
        }
        let mut missing = Vec::new();
        for batch in unpacked.chunks(MISSING_CHECK_BATCH_MAX) {
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

    /// Stores the bytes as given, without decoding them again: for bytes
    /// this process encoded itself or has just verified
    /// ([`crate::objects::put_batch_checked`]). In packs, in order.
    fn put_batch(&self, org: &OrgId, objects: &[(ObjectId, &[u8])]) -> Result<()> {
        if self.packing {
            self.write_packs(org, objects, None)?;
            return Ok(());
        }
        let batch: Vec<(String, &[u8])> = objects
            .iter()
            .map(|(object, stored)| (Self::object_key(org, object), *stored))
            .collect();
        self.backend.put_batch(&batch)?;
        self.packs().entry(org.clone()).or_default().loose = Some(true);
        Ok(())
    }

    fn get(&self, org: &OrgId, object: &ObjectId) -> Result<Option<Vec<u8>>> {
        if let Some(at) = self.locate(org, object)?
            && let Some(bytes) = self.read_located(org, object, &at)?
        {
            return Ok(Some(bytes));
        }
        if let Some(bytes) = self.backend.get(&Self::object_key(org, object))? {
            return Ok(Some(bytes));
        }
        // Written (or moved by a repack) since this process last listed.
        self.get_packed(org, object, false)
    }

    /// Packed objects a pack at a time, in offset order, neighbours in one
    /// ranged read ([`RANGE_GAP_BYTES_MAX`], [`RANGE_BYTES_MAX`]): one
    /// open of a local pack, one GET of S3 for many objects.
    fn get_batch(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<Option<Vec<u8>>>> {
        if !self.packs().get(org).is_some_and(|state| state.listed) {
            self.refresh_packs(org)?;
        }
        let mut out: Vec<Option<Vec<u8>>> = vec![None; objects.len()];
        let mut by_pack: HashMap<PackId, Vec<(usize, Location)>> = HashMap::new();
        let mut elsewhere: Vec<usize> = Vec::new();
        {
            let packs = self.packs();
            let state = packs.get(org);
            for (i, object) in objects.iter().enumerate() {
                match state.and_then(|s| s.locate(object)) {
                    Some(at) => by_pack.entry(at.pack).or_default().push((i, at)),
                    None => elsewhere.push(i),
                }
            }
        }
        let mut spans: Vec<Span> = Vec::new();
        let mut packs: Vec<(PackId, Vec<(usize, Location)>)> = by_pack.into_iter().collect();
        packs.sort_by_key(|(pack, _)| *pack);
        for (pack, mut wanted) in packs {
            wanted.sort_by_key(|(_, at)| at.offset);
            for (i, at) in wanted {
                let end = at.offset + u64::from(at.length);
                if let Some(span) = spans.last_mut()
                    && span.0 == pack
                    && at.offset >= span.2
                    && at.offset - span.2 <= RANGE_GAP_BYTES_MAX
                    && end - span.1 <= RANGE_BYTES_MAX
                {
                    span.2 = end;
                    span.3.push((i, at));
                } else {
                    spans.push((pack, at.offset, end, vec![(i, at)]));
                }
            }
        }
        let ranges: Vec<(String, u64, u64)> = spans
            .iter()
            .map(|(pack, start, end, _)| {
                (
                    Self::pack_key(org, pack, PackPart::Data),
                    *start,
                    end - start,
                )
            })
            .collect();
        let read = self.backend.get_ranges(&ranges)?;
        if read.len() != ranges.len() {
            return Err(Error::Backend {
                op: "get",
                key: ranges.first().map(|r| r.0.clone()).unwrap_or_default(),
                message: format!("{} ranges for {} asked", read.len(), ranges.len()),
            });
        }
        for ((_, start, _, inside), bytes) in spans.iter().zip(read) {
            let Some(bytes) = bytes else {
                // The pack went (a gc rewrote it): each object on its own,
                // which lists the packs again.
                elsewhere.extend(inside.iter().map(|(i, _)| *i));
                continue;
            };
            for (i, at) in inside {
                let from = ((at.offset - start) as usize).min(bytes.len());
                let to = (from + at.length as usize).min(bytes.len());
                // A truncated pack: what is there, which does not decode;
                // the reader's own read of the object names the pack.
                out[*i] = Some(bytes[from..to].to_vec());
            }
        }
        if !elsewhere.is_empty() {
            elsewhere.sort_unstable();
            let keys: Vec<String> = elsewhere
                .iter()
                .map(|&i| Self::object_key(org, &objects[i]))
                .collect();
            let loose = self.backend.get_batch(&keys)?;
            if loose.len() != keys.len() {
                return Err(Error::Backend {
                    op: "get",
                    key: keys.first().cloned().unwrap_or_default(),
                    message: format!("{} objects for {} asked", loose.len(), keys.len()),
                });
            }
            for (&i, bytes) in elsewhere.iter().zip(loose) {
                out[i] = match bytes {
                    Some(bytes) => Some(bytes),
                    None => self.get_packed(org, &objects[i], false)?,
                };
            }
        }
        Ok(out)
    }

    /// From the org's pack index ([`Store::locate`]).
    fn locations(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<Option<Location>>> {
        objects
            .iter()
            .map(|object| self.locate(org, object))
            .collect()
    }

    /// Where a request is a round trip (S3), a batch is a ranged read per
    /// pack; a local directory reads single objects faster, in parallel.
    fn reads_in_batches(&self) -> bool {
        self.backend.reads_in_batches()
    }

    fn upload_batch_limits(&self) -> (u64, usize) {
        if self.packing && self.backend.reads_in_batches() {
            // Requests cost: a pack's full size, half the PUTs.
            (crate::pack::PACK_BYTES_MAX, crate::pack::PACK_OBJECTS_MAX)
        } else if self.packing {
            (
                crate::pack::UPLOAD_PACK_BYTES,
                crate::pack::PACK_OBJECTS_MAX,
            )
        } else {
            (
                crate::push::UPLOAD_BATCH_BYTES_MAX,
                crate::push::UPLOAD_BATCH_OBJECTS_MAX,
            )
        }
    }
}

/// One ranged read of a pack: (pack, start, end, the objects inside by
/// their place in the batch).
type Span = (PackId, u64, u64, Vec<(usize, Location)>);

/// A ranged read of a pack that came back short: the pack is truncated.
fn check_range_len(object: &ObjectId, at: &Location, read: usize) -> Result<()> {
    if read as u64 != u64::from(at.length) {
        return Err(Error::Corrupt {
            digest: object.digest,
            path: None,
            reason: Corruption::Frame(format!(
                "pack {} holds {read} of its {} bytes at offset {} (truncated pack)",
                at.pack, at.length, at.offset
            )),
        });
    }
    Ok(())
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
    Object {
        org: OrgId,
        object: ObjectId,
    },
    Home {
        org: OrgId,
        home: HomeName,
    },
    Pack {
        org: OrgId,
        pack: PackId,
        part: PackPart,
    },
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
        ("packs", name, None, None) => {
            let (id, part) = match name.rsplit_once('.')? {
                (id, "pack") => (id, PackPart::Data),
                (id, "idx") => (id, PackPart::Index),
                _ => return None,
            };
            Some(KeyKind::Pack {
                org,
                pack: id.parse().ok()?,
                part,
            })
        }
        ("homes", home, None, None) => Some(KeyKind::Home {
            org,
            home: home.parse().ok()?,
        }),
        _ => None,
    }
}
