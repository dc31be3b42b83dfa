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
//! writes. Structure and memory: a merged index file per org in the local
//! index cache ([`crate::midx`]: every entry sorted by object, searched by
//! positioned reads; 0.125 bytes an object in memory for its sparse key
//! table, 16 bytes a pack), plus an overlay in memory of the packs listed
//! or written since that file was merged (a hash map: 73 bytes a slot, 1
//! to 2 slots an object, at most [`OVERLAY_OBJECTS_MAX`] objects before
//! it is merged into the file: ~9 MiB at most).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use crate::backend::{self, Backend, ObjectMeta};
use crate::midx::{self, MergedIndex};
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
/// Bytes a ranged read's buffer must have given to its objects before
/// it is shrunk ([`Objects::get_batch`] of a store): often enough to hold
/// a read about once, seldom enough that shrinking costs nothing.
const SHRINK_STEP_BYTES: usize = 1024 * 1024;
/// Most bytes one ranged read spans.
const RANGE_BYTES_MAX: u64 = 16 * 1024 * 1024;

/// How old a listing of an org's packs [`Store::stored_bytes`] answers
/// from: other processes' writes (other servers') count within it.
pub const STORED_BYTES_FRESH: std::time::Duration = std::time::Duration::from_secs(30);

/// Objects an org's in-memory overlay holds at most (packs listed or
/// written since its merged index file was written) before they are
/// merged into the file. With the pack that crosses it (at most
/// [`crate::pack::PACK_OBJECTS_MAX`] more) the overlay stays within 7/8
/// of a 131,072-slot table, the most it fills before doubling: ~9 MiB
/// of memory (73 bytes a slot; at 128Ki objects it doubled to ~19 MiB in
/// every first push of a 100k-file home). A merge rewrites the whole file
/// (49 bytes an object), so at 100 million objects one merge per 98,304
/// new objects writes ~5 GB.
pub const OVERLAY_OBJECTS_MAX: usize = 96 * 1024;
/// Pack indexes fetched from the store per request while refreshing
/// (a full pack's index is ~720 KiB: at most ~12 MiB held at once).
const INDEX_FETCH_BATCH: usize = 16;

pub struct Store {
    backend: Arc<dyn Backend>,
    lock_timing: LockTiming,
    /// Whether `put_batch` writes packs (every store) or one key per
    /// object (a runner's block cache, which fills object by object).
    packing: bool,
    packs: Mutex<HashMap<OrgId, OrgPacks>>,
    /// One listing-and-merge at a time per org, so an older listing is
    /// never applied over a newer one.
    refreshing: Mutex<HashMap<OrgId, Arc<Mutex<()>>>>,
    /// The local directory of each org's merged index and of copies of
    /// the pack indexes read or written since it was merged.
    index_cache: IndexCache,
    overlay_max: usize,
}

/// Where the org indexes live: a directory the caller names, kept across
/// processes, or one of this process's own in the system's temporary
/// directory, removed with the store.
enum IndexCache {
    Kept(PathBuf),
    Own(OwnDir),
}

struct OwnDir(PathBuf);

impl Drop for OwnDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl IndexCache {
    fn own() -> IndexCache {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut random = [0u8; 8];
        let _ = getrandom::fill(&mut random);
        IndexCache::Own(OwnDir(std::env::temp_dir().join(format!(
            "roost-pack-index-{}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            u64::from_le_bytes(random)
        ))))
    }

    fn dir(&self) -> &Path {
        match self {
            IndexCache::Kept(dir) => dir,
            IndexCache::Own(own) => &own.0,
        }
    }
}

/// An org's pack index: the merged file, and in memory the packs known
/// since it was written.
#[derive(Default)]
struct OrgPacks {
    /// Whether the org's packs were listed at least once.
    listed: bool,
    /// Whether this process looked for the org's merged file yet.
    opened: bool,
    /// Whether writing the merged file failed (an unwritable cache): the
    /// index then stays whole in the overlay, unbounded.
    cache_failed: bool,
    merged: Option<Arc<MergedIndex>>,
    /// Objects of `overlay_packs`, by name (one pack per object).
    overlay: HashMap<ObjectId, Location>,
    overlay_packs: HashSet<PackId>,
    /// Indexes that lie ([`crate::pack::decode_index`]): their objects
    /// count as absent (re-uploaded; nothing is read through them).
    refused: HashSet<PackId>,
    /// Whether objects stored one per key may exist (checked once: this
    /// process's own single-object writes set it).
    loose: Option<bool>,
    /// The bytes of the org's packs and their indexes as last listed,
    /// plus those this process wrote since ([`Store::stored_bytes`]).
    bytes: u64,
    /// When the org's packs were last listed.
    listed_at: Option<std::time::Instant>,
}

impl OrgPacks {
    fn knows(&self, pack: &PackId) -> bool {
        self.overlay_packs.contains(pack) || self.merged.as_ref().is_some_and(|m| m.has_pack(pack))
    }

    fn add(&mut self, index: &PackIndex) {
        if self.knows(&index.pack) {
            return;
        }
        self.overlay_packs.insert(index.pack);
        self.overlay.reserve(index.entries.len());
        for entry in &index.entries {
            self.overlay.entry(entry.object).or_insert(Location {
                pack: index.pack,
                offset: entry.offset,
                length: entry.length,
            });
        }
    }
}

/// An org's pack index in one process ([`Store::index_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Packs and entries of the merged file in use (on disk).
    pub merged_packs: usize,
    pub merged_entries: u64,
    /// Packs and objects in the in-memory overlay.
    pub overlay_packs: usize,
    pub overlay_objects: usize,
    /// Objects the overlay's table has room for: the memory it holds.
    pub overlay_capacity: usize,
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
            refreshing: Mutex::new(HashMap::new()),
            index_cache: IndexCache::own(),
            overlay_max: OVERLAY_OBJECTS_MAX,
        }
    }

    /// This store keeping its org indexes under `dir` (one directory per
    /// store: the caller names it), for later processes: each org's merged
    /// index ([`crate::midx`]) and copies of the pack indexes read or
    /// written since it was merged. Losing them costs reading the pack
    /// indexes from the store again; a file that does not check (checksum,
    /// org, pack) is rebuilt or read again from the store. Without it, a
    /// store keeps them in a temporary directory of its own.
    pub fn with_index_cache(self, dir: PathBuf) -> Store {
        Store {
            index_cache: IndexCache::Kept(dir),
            ..self
        }
    }

    /// This store merging its in-memory overlay into the org's merged
    /// index past `objects` (tests; see [`OVERLAY_OBJECTS_MAX`]).
    pub fn with_overlay_max(self, objects: usize) -> Store {
        Store {
            overlay_max: objects,
            ..self
        }
    }

    fn org_index_dir(&self, org: &OrgId) -> PathBuf {
        self.index_cache.dir().join(org.as_str())
    }

    /// Where `org`'s merged index file is (present or not).
    pub fn merged_index_path(&self, org: &OrgId) -> PathBuf {
        self.org_index_dir(org).join(midx::FILE_NAME)
    }

    fn cached_index_path(&self, org: &OrgId, pack: &PackId) -> PathBuf {
        self.org_index_dir(org).join(format!("{pack}.idx"))
    }

    /// An index from the local cache, if there and sound.
    fn cached_index(&self, org: &OrgId, pack: &PackId) -> Option<PackIndex> {
        let bytes = std::fs::read(self.cached_index_path(org, pack)).ok()?;
        crate::pack::decode_index(org, pack, &bytes).ok()
    }

    /// Keeps a copy of an index (until it is merged); a failure only
    /// costs a later read from the store.
    fn cache_index(&self, org: &OrgId, pack: &PackId, bytes: &[u8]) {
        let path = self.cached_index_path(org, pack);
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

    /// Removes cached copies of indexes that `drop` names, given their
    /// age (merged, or their packs gone), and temporary files a killed
    /// process left an hour ago or more.
    fn prune_index_cache(&self, org: &OrgId, drop: impl Fn(&PackId, Duration) -> bool) {
        for entry in std::fs::read_dir(self.org_index_dir(org))
            .into_iter()
            .flatten()
            .flatten()
        {
            let age = entry
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|modified| modified.elapsed().ok())
                .unwrap_or_default();
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let pruned = match name.strip_suffix(".idx") {
                Some(id) => id.parse::<PackId>().is_ok_and(|pack| drop(&pack, age)),
                None => name.contains(".tmp") && age > Duration::from_secs(3600),
            };
            if pruned {
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

    /// The store at `url`; a local one is made if absent (writers).
    pub fn open(url: &str) -> Result<Store> {
        Ok(Store::new(backend::open(url)?))
    }

    /// The store at `url`, which must exist if local: a missing directory
    /// is [`crate::Error::NoStore`] and nothing is made (readers).
    pub fn open_existing(url: &str) -> Result<Store> {
        Ok(Store::new(backend::open_existing(url)?))
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

    fn refresh_lock(&self, org: &OrgId) -> Arc<Mutex<()>> {
        let mut locks = self.refreshing.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(locks.entry(org.clone()).or_default())
    }

    /// The org's merged index from the cache, if there and sound; one
    /// that is not is rebuilt by the caller.
    fn open_merged(&self, org: &OrgId) -> Option<Arc<MergedIndex>> {
        let path = self.merged_index_path(org);
        match MergedIndex::open(&path, org) {
            Ok(merged) => merged.map(Arc::new),
            Err(reason) => {
                tracing::warn!(%org, path = %path.display(), %reason, "merged pack index refused; rebuilding it");
                None
            }
        }
    }

    /// Reads the indexes of `packs` (a local copy if there and sound, else
    /// from the store, a few per request) and hands each to `each`, in
    /// order, until it says stop. Packs gone since they were listed are
    /// skipped; indexes that lie are skipped and pushed to `refused`.
    /// `keep_copies`: cache those read from the store.
    fn for_each_index(
        &self,
        org: &OrgId,
        packs: &[PackId],
        keep_copies: bool,
        refused: &mut Vec<PackId>,
        mut each: impl FnMut(PackIndex) -> Result<bool>,
    ) -> Result<()> {
        for group in packs.chunks(INDEX_FETCH_BATCH) {
            let mut uncached = Vec::new();
            for pack in group {
                match self.cached_index(org, pack) {
                    Some(index) => {
                        if !each(index)? {
                            return Ok(());
                        }
                    }
                    None => uncached.push(*pack),
                }
            }
            let keys: Vec<String> = uncached
                .iter()
                .map(|pack| Self::pack_key(org, pack, PackPart::Index))
                .collect();
            let fetched = self.backend.get_batch(&keys)?;
            for (pack, bytes) in uncached.iter().zip(fetched) {
                // Gone since the listing: removed by a gc, like one unlisted.
                let Some(bytes) = bytes else { continue };
                match crate::pack::decode_index(org, pack, &bytes) {
                    Ok(index) => {
                        if keep_copies {
                            self.cache_index(org, pack, &bytes);
                        }
                        if !each(index)? {
                            return Ok(());
                        }
                    }
                    Err(reason) => {
                        tracing::warn!(%org, %pack, %reason, "pack index refused; its objects count as absent");
                        refused.push(*pack);
                    }
                }
            }
        }
        Ok(())
    }

    /// Lists the org's pack indexes and brings its index up to them. Packs
    /// not yet known go to the in-memory overlay; everything listed is
    /// merged into a new merged file instead when the overlay would pass
    /// its bound, when there is no merged file yet, or when a known pack
    /// is gone (gc removed or rewrote it: the file's entries of it must
    /// not be used, and the file is rebuilt from itself without them and
    /// the listed indexes, a merge of sorted runs).
    fn refresh_packs(&self, org: &OrgId) -> Result<()> {
        let lock = self.refresh_lock(org);
        let _one_at_a_time = lock.lock().unwrap_or_else(|p| p.into_inner());
        // What this process knows, taken before listing: a pack it writes
        // meanwhile is then never taken for one gone.
        let (opened, cache_failed, mut merged, overlay_packs, overlay_len, refused) = {
            let packs = self.packs();
            match packs.get(org) {
                Some(s) => (
                    s.opened,
                    s.cache_failed,
                    s.merged.clone(),
                    s.overlay_packs.clone(),
                    s.overlay.len(),
                    s.refused.clone(),
                ),
                None => (false, false, None, HashSet::new(), 0, HashSet::new()),
            }
        };
        if !opened {
            merged = self.open_merged(org);
        }
        let mut listed: Vec<PackId> = Vec::new();
        let mut listed_bytes = 0u64;
        for meta in self.backend.list(&Self::packs_prefix(org))? {
            listed_bytes = listed_bytes.saturating_add(meta.size);
            if let Some(KeyKind::Pack {
                pack,
                part: PackPart::Index,
                ..
            }) = parse_key(&meta.key)
            {
                listed.push(pack);
            }
        }
        // What the org's packs take, as listed (a pack this process
        // writes meanwhile may be counted twice, or not at all, until the
        // next listing).
        {
            let mut packs = self.packs();
            let state = packs.entry(org.clone()).or_default();
            state.bytes = listed_bytes;
            state.listed_at = Some(std::time::Instant::now());
        }
        let listed_set: HashSet<PackId> = listed.iter().copied().collect();
        let in_merged = |pack: &PackId| merged.as_ref().is_some_and(|m| m.has_pack(pack));
        let gone: HashSet<PackId> = merged
            .iter()
            .flat_map(|m| m.packs().iter())
            .chain(overlay_packs.iter())
            .filter(|pack| !listed_set.contains(pack))
            .copied()
            .collect();
        let unmerged: Vec<PackId> = listed
            .iter()
            .filter(|pack| !in_merged(pack) && !refused.contains(pack))
            .copied()
            .collect();
        let new: Vec<PackId> = unmerged
            .iter()
            .filter(|pack| !overlay_packs.contains(pack))
            .copied()
            .collect();
        let mut newly_refused = Vec::new();
        if cache_failed && !gone.is_empty() {
            return self.index_in_memory(org, &listed, &refused, newly_refused);
        }
        let mut merging = !cache_failed
            && (!gone.is_empty()
                || (merged.is_none() && !new.is_empty())
                || overlay_len > self.overlay_max);
        let mut fresh: Vec<PackIndex> = Vec::new();
        if !merging {
            let mut entries = overlay_len;
            self.for_each_index(org, &new, true, &mut newly_refused, |index| {
                entries += index.entries.len();
                fresh.push(index);
                merging = !cache_failed && entries > self.overlay_max;
                Ok(!merging)
            })?;
        }
        let mut packs_merged = None;
        if merging {
            let fresh = std::mem::take(&mut fresh);
            let merge = self.merge_listed(
                org,
                merged.as_deref(),
                fresh,
                &unmerged,
                &listed_set,
                &mut newly_refused,
            )?;
            match merge {
                Ok(built) => {
                    self.prune_index_cache(org, |pack, age| {
                        built.has_pack(pack)
                            || gone.contains(pack)
                            || (!listed_set.contains(pack) && age > self.lock_timing.stale)
                    });
                    packs_merged = Some(Arc::new(built));
                }
                Err(err) => {
                    let dir = self.org_index_dir(org);
                    tracing::warn!(%org, %err, dir = %dir.display(), "cannot write the merged pack index; this process keeps the org's index in memory");
                    return self.index_in_memory(org, &listed, &refused, newly_refused);
                }
            }
        }
        let mut packs = self.packs();
        let state = packs.entry(org.clone()).or_default();
        match packs_merged {
            Some(built) => {
                // Packs this process wrote since the listing stay in the
                // overlay; the merged ones and the gone ones leave it.
                state
                    .overlay_packs
                    .retain(|pack| !built.has_pack(pack) && !gone.contains(pack));
                let kept = &state.overlay_packs;
                state.overlay.retain(|_, at| kept.contains(&at.pack));
                // Retaining keeps the table's size: give it back, or a
                // long-lived process (server, runner) keeps each org's
                // largest overlay (~9 MiB) for good.
                state.overlay.shrink_to_fit();
                state.overlay_packs.shrink_to_fit();
                state.merged = Some(built);
            }
            None => {
                if !opened {
                    state.merged = merged;
                }
                for index in &fresh {
                    state.add(index);
                }
            }
        }
        state.opened = true;
        state.listed = true;
        state.refused.extend(newly_refused);
        Ok(())
    }

    /// The bytes the org's packs take in the store: as last listed (every
    /// existence answer lists them, and this lists them again when that
    /// was more than [`STORED_BYTES_FRESH`] ago, so other processes'
    /// writes are seen), plus what this process wrote since. Objects
    /// stored one per key (from before packs) are not counted. What an
    /// org's quota on stored bytes is checked against.
    pub fn stored_bytes(&self, org: &OrgId) -> Result<u64> {
        let fresh = self.packs().get(org).is_some_and(|state| {
            state.listed
                && state
                    .listed_at
                    .is_some_and(|at| at.elapsed() < STORED_BYTES_FRESH)
        });
        if !fresh {
            self.refresh_packs(org)?;
        }
        Ok(self.packs().get(org).map_or(0, |state| state.bytes))
    }

    /// What this process holds of the org's pack index (zero if it has
    /// not read it yet).
    pub fn index_stats(&self, org: &OrgId) -> IndexStats {
        let packs = self.packs();
        let Some(state) = packs.get(org) else {
            return IndexStats::default();
        };
        IndexStats {
            merged_packs: state.merged.as_ref().map_or(0, |m| m.packs().len()),
            merged_entries: state.merged.as_ref().map_or(0, |m| m.len()),
            overlay_packs: state.overlay_packs.len(),
            overlay_objects: state.overlay.len(),
            overlay_capacity: state.overlay.capacity(),
        }
    }

    /// Merges the org's merged file (its entries of packs still listed)
    /// with the indexes of `fresh` and of the other `unmerged` packs into
    /// a new merged file. The outer error is the store's; the inner one
    /// the local cache's (the caller then keeps the index in memory).
    fn merge_listed(
        &self,
        org: &OrgId,
        merged: Option<&MergedIndex>,
        fresh: Vec<PackIndex>,
        unmerged: &[PackId],
        listed: &HashSet<PackId>,
        refused: &mut Vec<PackId>,
    ) -> Result<std::io::Result<MergedIndex>> {
        let mut builder = match midx::Builder::new(&self.org_index_dir(org)) {
            Ok(builder) => builder,
            Err(err) => return Ok(Err(err)),
        };
        let mut failed = None;
        let mut done = HashSet::new();
        for index in fresh {
            done.insert(index.pack);
            if let Err(err) = builder.add(&index) {
                return Ok(Err(err));
            }
        }
        let rest: Vec<PackId> = unmerged
            .iter()
            .filter(|pack| !done.contains(pack))
            .copied()
            .collect();
        self.for_each_index(org, &rest, false, refused, |index| {
            if let Err(err) = builder.add(&index) {
                failed = Some(err);
            }
            Ok(failed.is_none())
        })?;
        if let Some(err) = failed {
            return Ok(Err(err));
        }
        let keep = |pack: &PackId| listed.contains(pack);
        Ok(builder.finish(org, merged, &keep))
    }

    /// The org's whole index in memory (every listed pack's entries in the
    /// overlay, no merged file), for a process that cannot write its index
    /// cache: correct, but 73-146 bytes an object, as before merged
    /// files. This process does not try the cache again.
    fn index_in_memory(
        &self,
        org: &OrgId,
        listed: &[PackId],
        refused: &HashSet<PackId>,
        mut newly_refused: Vec<PackId>,
    ) -> Result<()> {
        let wanted: Vec<PackId> = listed
            .iter()
            .filter(|pack| !refused.contains(pack))
            .copied()
            .collect();
        let mut indexes = Vec::new();
        self.for_each_index(org, &wanted, false, &mut newly_refused, |index| {
            indexes.push(index);
            Ok(true)
        })?;
        let mut packs = self.packs();
        let state = packs.entry(org.clone()).or_default();
        state.merged = None;
        state.overlay.clear();
        state.overlay_packs.clear();
        for index in &indexes {
            state.add(index);
        }
        state.cache_failed = true;
        state.opened = true;
        state.listed = true;
        state.refused.extend(newly_refused);
        Ok(())
    }

    /// Where a packed object is, listing the org's packs first if this
    /// process has not yet (`None`: in no pack this process knows of).
    pub fn locate(&self, org: &OrgId, object: &ObjectId) -> Result<Option<Location>> {
        Ok(self.locate_all(org, std::slice::from_ref(object))?[0])
    }

    /// Where each packed object is (see [`Store::locate`]): the overlay in
    /// memory first, then the merged file (outside the lock: positioned
    /// reads of a file no one changes).
    fn locate_all(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<Option<Location>>> {
        if !self.packs().get(org).is_some_and(|state| state.listed) {
            self.refresh_packs(org)?;
        }
        let (mut found, merged) = {
            let packs = self.packs();
            let Some(state) = packs.get(org) else {
                return Ok(vec![None; objects.len()]);
            };
            let found: Vec<Option<Location>> = objects
                .iter()
                .map(|object| state.overlay.get(object).copied())
                .collect();
            (found, state.merged.clone())
        };
        if let Some(merged) = merged {
            for (at, object) in found.iter_mut().zip(objects) {
                if at.is_none() {
                    *at = merged.lookup(object).map_err(|source| Error::Io {
                        path: merged.path().to_owned(),
                        source,
                    })?;
                }
            }
        }
        Ok(found)
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
        let written = (bytes.len() + index_bytes.len()) as u64;
        // The data durable before its index exists: an index that outlived
        // its pack's bytes (a power loss before the push's sync) would have
        // every later push skip those objects as stored.
        self.backend
            .put_owned_durable(&Self::pack_key(org, &pack, PackPart::Data), bytes)?;
        self.backend
            .put(&Self::pack_key(org, &pack, PackPart::Index), &index_bytes)?;
        // Known at once to this process; others find it by listing. Its
        // index is kept locally until merged, so a later process need not
        // read it from the store.
        self.cache_index(org, &pack, &index_bytes);
        let merge_due = {
            let mut packs = self.packs();
            let state = packs.entry(org.clone()).or_default();
            state.add(&index);
            state.bytes = state.bytes.saturating_add(written);
            !state.cache_failed && state.overlay.len() > self.overlay_max
        };
        if merge_due {
            self.refresh_packs(org)?;
        }
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
        self.cache_index(org, &index.pack, bytes);
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
        let unpacked: Vec<ObjectId> = objects
            .iter()
            .zip(self.locate_all(org, objects)?)
            .filter(|(_, at)| at.is_none())
            .map(|(object, _)| *object)
            .collect();
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

    /// A batch push built as one pack is written as that pack, without
    /// a copy; one past a pack's bounds is split as [`Objects::put_batch`]
    /// splits it.
    fn put_pack(&self, org: &OrgId, pack: PackBuilder) -> Result<()> {
        if pack.is_empty() {
            return Ok(());
        }
        if self.packing && pack.within_bounds() {
            self.write_pack(org, pack, None)?;
            return Ok(());
        }
        let objects: Vec<(ObjectId, &[u8])> = pack.objects().collect();
        self.put_batch(org, &objects)
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
        let mut out: Vec<Option<Vec<u8>>> = vec![None; objects.len()];
        let (spans, mut elsewhere) = self.spans(org, objects)?;
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
            let Some(mut bytes) = bytes else {
                // The pack went (a gc rewrote it): each object on its own,
                // which lists the packs again.
                elsewhere.extend(inside.iter().map(|(i, _)| *i));
                continue;
            };
            // Cut from the end, giving back each object's bytes as it is
            // copied out, so a read of many objects is held about once,
            // not as the read and then as its objects.
            for (i, at) in inside.iter().rev() {
                let from = ((at.offset - start) as usize).min(bytes.len());
                let to = (from + at.length as usize).min(bytes.len());
                // A truncated pack: what is there, which does not decode;
                // the reader's own read of the object names the pack.
                out[*i] = Some(bytes[from..to].to_vec());
                bytes.truncate(from);
                if bytes.capacity() - bytes.len() >= SHRINK_STEP_BYTES {
                    bytes.shrink_to_fit();
                }
            }
        }
        self.get_elsewhere(org, objects, elsewhere, &mut |i, bytes| {
            out[i] = bytes;
            Ok(())
        })?;
        Ok(out)
    }

    /// Each pack's span read as one streamed ranged read, every object
    /// handed on as soon as its last byte arrives: what is held is the
    /// object in progress, never the read.
    fn get_batch_each(
        &self,
        org: &OrgId,
        objects: &[ObjectId],
        each: &mut dyn FnMut(usize, Option<Vec<u8>>) -> Result<()>,
    ) -> Result<()> {
        let (spans, mut elsewhere) = self.spans(org, objects)?;
        for (pack, start, end, inside) in &spans {
            let mut reading = SpanReader::new(*start, inside);
            let key = Self::pack_key(org, pack, PackPart::Data);
            let found = self
                .backend
                .get_range_each(&key, *start, end - start, &mut |piece| {
                    reading.take(piece, each)
                })?;
            if found {
                reading.finish(each)?;
            } else {
                // The pack went (a gc rewrote it): each object on its own,
                // which lists the packs again.
                elsewhere.extend(inside.iter().map(|(i, _)| *i));
            }
        }
        self.get_elsewhere(org, objects, elsewhere, each)
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

impl Store {
    /// Where `objects` lie: the ranged reads of packs that fetch them
    /// (a pack at a time, in offset order, neighbours in one read:
    /// [`RANGE_GAP_BYTES_MAX`], [`RANGE_BYTES_MAX`]), and the places in
    /// `objects` of those no pack this process knows holds.
    fn spans(&self, org: &OrgId, objects: &[ObjectId]) -> Result<(Vec<Span>, Vec<usize>)> {
        let mut by_pack: HashMap<PackId, Vec<(usize, Location)>> = HashMap::new();
        let mut elsewhere: Vec<usize> = Vec::new();
        for (i, at) in self.locate_all(org, objects)?.into_iter().enumerate() {
            match at {
                Some(at) => by_pack.entry(at.pack).or_default().push((i, at)),
                None => elsewhere.push(i),
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
        Ok((spans, elsewhere))
    }

    /// The objects at places `elsewhere` in `objects`, each under its own
    /// key (a store from before packs), or, absent there, in a pack
    /// listed since (a gc moved it), handed to `each`.
    fn get_elsewhere(
        &self,
        org: &OrgId,
        objects: &[ObjectId],
        mut elsewhere: Vec<usize>,
        each: &mut dyn FnMut(usize, Option<Vec<u8>>) -> Result<()>,
    ) -> Result<()> {
        if elsewhere.is_empty() {
            return Ok(());
        }
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
            let bytes = match bytes {
                Some(bytes) => Some(bytes),
                None => self.get_packed(org, &objects[i], false)?,
            };
            each(i, bytes)?;
        }
        Ok(())
    }
}

/// Cuts a span's objects out of its ranged read as the read arrives
/// ([`Objects::get_batch_each`] of a store): each object is gathered into
/// a buffer of its own length, handed on whole.
struct SpanReader<'s> {
    /// The span's objects, by place in the batch, in offset order.
    inside: &'s [(usize, Location)],
    /// The first of `inside` not yet handed on.
    next: usize,
    /// The pack offset of the next byte to arrive.
    at: u64,
    /// What has arrived of `inside[next]` (empty until its first byte).
    begun: Vec<u8>,
}

impl<'s> SpanReader<'s> {
    fn new(start: u64, inside: &'s [(usize, Location)]) -> SpanReader<'s> {
        SpanReader {
            inside,
            next: 0,
            at: start,
            begun: Vec::new(),
        }
    }

    /// Takes the next piece of the read: skips the gaps between objects,
    /// hands on every object the piece completes.
    fn take(
        &mut self,
        mut piece: &[u8],
        each: &mut dyn FnMut(usize, Option<Vec<u8>>) -> Result<()>,
    ) -> Result<()> {
        while let Some((i, loc)) = self.inside.get(self.next) {
            let piece_end = self.at + piece.len() as u64;
            if loc.offset >= piece_end {
                break;
            }
            if loc.offset > self.at {
                piece = &piece[(loc.offset - self.at) as usize..];
                self.at = loc.offset;
            }
            if self.begun.capacity() == 0 {
                self.begun = Vec::with_capacity(loc.length as usize);
            }
            let end = loc.offset + u64::from(loc.length);
            let take = piece.len().min((end - self.at) as usize);
            self.begun.extend_from_slice(&piece[..take]);
            piece = &piece[take..];
            self.at += take as u64;
            if self.at < end {
                break;
            }
            each(*i, Some(std::mem::take(&mut self.begun)))?;
            self.next += 1;
        }
        self.at += piece.len() as u64;
        Ok(())
    }

    /// The read ended: objects it did not complete (a truncated pack) get
    /// what arrived of them, which does not decode; the reader's own read
    /// of the object names the pack.
    fn finish(mut self, each: &mut dyn FnMut(usize, Option<Vec<u8>>) -> Result<()>) -> Result<()> {
        for (i, _) in &self.inside[self.next..] {
            each(*i, Some(std::mem::take(&mut self.begun)))?;
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Objects at `(offset, length)` in a pack of `pack` bytes, as a span
    /// from the first one's offset, read in pieces of `piece` bytes and
    /// cut short at `read_to`: what [`SpanReader`] hands on for each.
    fn cut(
        pack: &[u8],
        objects: &[(u64, u32)],
        piece: usize,
        read_to: usize,
    ) -> Vec<(usize, Vec<u8>)> {
        let inside: Vec<(usize, Location)> = objects
            .iter()
            .enumerate()
            .map(|(i, &(offset, length))| {
                let pack = PackId([1; 16]);
                (
                    i,
                    Location {
                        pack,
                        offset,
                        length,
                    },
                )
            })
            .collect();
        let start = objects[0].0 as usize;
        let mut handed = Vec::new();
        let mut each = |i: usize, bytes: Option<Vec<u8>>| -> Result<()> {
            handed.push((i, bytes.expect("bytes")));
            Ok(())
        };
        let mut reading = SpanReader::new(start as u64, &inside);
        for piece in pack[start..read_to].chunks(piece) {
            reading.take(piece, &mut each).expect("take");
        }
        reading.finish(&mut each).expect("finish");
        handed
    }

    /// Every object whole, in order, whatever the pieces: one byte at a
    /// time, pieces ending inside objects and inside the gaps between
    /// them, one piece for the whole read.
    #[test]
    fn a_span_read_in_pieces_hands_on_each_object_whole() {
        let pack: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        // Gaps between the objects (ones not asked for), one empty object.
        let objects = [(100, 300), (400, 1), (401, 0), (900, 2000), (3500, 1500)];
        let want: Vec<(usize, Vec<u8>)> = objects
            .iter()
            .enumerate()
            .map(|(i, &(o, l))| (i, pack[o as usize..o as usize + l as usize].to_vec()))
            .collect();
        for piece in [1, 7, 64, 299, 300, 301, 1000, 5000] {
            assert_eq!(cut(&pack, &objects, piece, 5000), want, "pieces of {piece}");
        }
    }

    /// A read that ends early (a truncated pack): the object it was in
    /// gets what arrived of it, later ones nothing; none is handed twice.
    #[test]
    fn a_span_read_cut_short_hands_on_what_arrived() {
        let pack: Vec<u8> = (0..5000u32).map(|i| (i % 256) as u8).collect();
        let objects = [(0, 1000), (1000, 1000), (2500, 1000)];
        for piece in [1, 333, 5000] {
            let handed = cut(&pack, &objects, piece, 1500);
            assert_eq!(
                handed,
                vec![
                    (0, pack[..1000].to_vec()),
                    (1, pack[1000..1500].to_vec()),
                    (2, Vec::new()),
                ],
                "pieces of {piece}"
            );
        }
    }
}

#[cfg(test)]
mod durability_tests {
    use super::*;
    use crate::backend::MemoryBackend;

    /// Logs each write and sync, in order.
    #[derive(Default)]
    struct Logged {
        inner: MemoryBackend,
        log: Mutex<Vec<String>>,
    }

    impl Logged {
        fn note(&self, what: String) {
            self.log
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(what);
        }
    }

    impl Backend for Logged {
        fn put(&self, key: &str, data: &[u8]) -> Result<()> {
            self.note(format!("put {key}"));
            self.inner.put(key, data)
        }
        fn put_durable(&self, key: &str, data: &[u8]) -> Result<()> {
            self.note(format!("put_durable {key}"));
            self.inner.put_durable(key, data)
        }
        fn sync(&self) -> Result<()> {
            self.note("sync".to_owned());
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

    /// An org's stored bytes are its packs' and their indexes', whoever
    /// wrote them, and never another org's.
    #[test]
    fn an_orgs_stored_bytes_are_its_packs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let backend = Arc::new(crate::backend::LocalBackend::open(dir.path()).expect("open"));
        let writer = Store::new(backend.clone());
        let (acme, other): (OrgId, OrgId) =
            ("acme".parse().expect("org"), "other".parse().expect("org"));
        assert_eq!(writer.stored_bytes(&acme).expect("none yet"), 0);
        let stored = vec![7u8; 10_000];
        let object = ObjectId::block(Digest::of(b"one"));
        writer
            .write_packs(&acme, &[(object, &stored[..])], None)
            .expect("written");
        let on_disk: u64 = backend
            .list(&Store::packs_prefix(&acme))
            .expect("list")
            .iter()
            .map(|meta| meta.size)
            .sum();
        assert!(on_disk > 10_000, "{on_disk}");
        assert_eq!(writer.stored_bytes(&acme).expect("counted"), on_disk);
        // Another process finds the same by listing.
        let reader = Store::new(backend.clone());
        assert_eq!(reader.stored_bytes(&acme).expect("listed"), on_disk);
        assert_eq!(reader.stored_bytes(&other).expect("listed"), 0);
    }

    /// Audit finding: a pack's data and index went to a local store with
    /// no fsync and in no order, so a power loss before the push's sync
    /// could keep an index naming lost bytes, and every later push would
    /// skip those objects as stored. The data is durable before its index
    /// is written.
    #[test]
    fn a_packs_data_is_durable_before_its_index_is_written() {
        let logged = Arc::new(Logged::default());
        let store = Store::new(logged.clone());
        let org: OrgId = "acme".parse().expect("an org");
        let stored = b"some stored bytes".to_vec();
        let object = ObjectId::block(Digest::of(b"one"));
        let packs = store
            .write_packs(&org, &[(object, &stored[..])], None)
            .expect("written");
        assert_eq!(packs.len(), 1);
        let log = logged.log.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let at = |needle: &str| {
            log.iter()
                .position(|entry| entry.starts_with(needle))
                .unwrap_or_else(|| panic!("no {needle:?} in {log:?}"))
        };
        let data = log
            .iter()
            .position(|entry| entry.ends_with(".pack"))
            .unwrap_or_else(|| panic!("no data put in {log:?}"));
        let index = log
            .iter()
            .position(|entry| entry.ends_with(".idx"))
            .unwrap_or_else(|| panic!("no index put in {log:?}"));
        let sync = at("sync");
        assert!(data < sync && sync < index, "{log:?}");
    }
}
