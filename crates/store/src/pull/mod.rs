//! Pull: materialise a home's tree into a directory, from any
//! [`Objects`] (a store this process holds, or the block service).
//!
//! Two rooms: `plan` decides what to fetch when (every tree first, a level
//! per batch, then windows of small files' blocks), `write` makes the
//! destination match the tree through directory handles. Every tree is in
//! hand before a byte is written, so a tree nested deeper than
//! [`crate::tree::DEPTH_MAX`] or expanding past the bounds
//! [`crate::tree::check_bounds`] checks (entries, file bytes, block
//! references, distinct tree bytes) is refused up front: the writing's
//! recursion and what it holds are bounded. This module holds the options, the report, and where bytes come from (the local
//! block cache, what a window fetched ahead, or the objects one by one).
//!
//! Safety: every filesystem call is relative to a directory handle and
//! names a single validated component; directories are opened with
//! `O_NOFOLLOW`, files are created `O_EXCL` under a temporary name and
//! renamed into place (which replaces a symlink or a hard link rather than
//! writing through it), and metadata is set on our own handles after the
//! content. So a hostile tree, or a destination already holding symlinks,
//! cannot make us write outside the target. Every block is verified
//! against its digest before a byte of it is written.
//!
//! Speed: directories are processed in parallel; files whose current stat
//! matches the local index with the same blocks are left alone; blocks come
//! from the optional local block cache before the store; all-zero 4 MiB
//! blocks of large files become holes. Where a request per object would
//! cost a round trip (the block service, [`Objects::reads_in_batches`]),
//! every tree is fetched first, a level at a time, and then the blocks of
//! small files come in windows: a directory's own files, or whole subtrees
//! this pull creates, several per window, so a home of many small
//! directories takes few requests; into an empty directory, every block
//! in the order it is stored, a pack per window (`fresh`).

mod fresh;
mod plan;
mod write;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustix::fs::{Mode, OFlags};

use crate::backend::LocalBackend;
use crate::index::{Index, LastSync};
use crate::objects::Objects;
use crate::progress::Progress;
use crate::store::ObjectId;
use crate::tree::Tree;
use crate::{Digest, Error, HomeName, OrgId, Result, Store, block};

/// Objects fetched ahead of their use: stored bytes, already counted (and
/// written to the block cache when the pull fills it).
type Prefetched = HashMap<ObjectId, Vec<u8>>;

pub struct PullOptions {
    /// A local block cache directory, read before the store.
    pub cache: Option<PathBuf>,
    /// Whether what is downloaded is also written into `cache`. Worth it
    /// for objects many destinations share (images); a home is its own
    /// copy on the runner, and writing its every block a second time cost
    /// a third of a wake on a fresh runner.
    pub fill_cache: bool,
    /// The destination's file index (read to skip unchanged files, then
    /// rewritten so the next push of the destination hashes nothing).
    pub index_path: Option<PathBuf>,
    pub store_id: String,
    /// Replaces the device number in index keys (see
    /// [`crate::index::KeyRule`]), for homes later read through snapshots.
    pub index_dev: Option<u64>,
    /// Into an empty directory, refuse a tree whose files' bytes or
    /// entries pass what the directory's file system has free
    /// ([`Error::NoRoom`]), before a byte is written: a runner pulling an
    /// org's tree shares its disk with every other tenant.
    pub check_room: bool,
    /// With `check_room`, another file system the bytes land on, whose
    /// free space must hold them too: the one under a loop-mounted
    /// destination (a sparse image reports its own size as free).
    pub room_also: Option<PathBuf>,
}

/// Refuses a pull into the empty `dest` of a tree that expands past what
/// its file system has free: logical bytes (holes counted, as they may be
/// written) against the space an unprivileged writer may use, and entries
/// against free inodes where the file system counts them (btrfs does not).
/// A directory already holding files is let be: most of the tree may be
/// there already.
fn check_room(
    dest_fd: &std::os::fd::OwnedFd,
    dest: &Path,
    root: &Digest,
    extent: &crate::tree::Extent,
    also: Option<&Path>,
) -> Result<()> {
    let io = |e: rustix::io::Errno| Error::Io {
        path: dest.to_owned(),
        source: e.into(),
    };
    if !write::is_empty_dir(dest_fd).map_err(io)? {
        return Ok(());
    }
    let stat = rustix::fs::fstatvfs(dest_fd).map_err(io)?;
    let no_room = |unit, needed, free| Error::NoRoom {
        what: format!("tree {root}"),
        path: dest.to_owned(),
        unit,
        needed,
        free,
    };
    let free_bytes = stat.f_bavail.saturating_mul(stat.f_frsize);
    if extent.file_bytes > free_bytes {
        return Err(no_room("bytes", extent.file_bytes, free_bytes));
    }
    if stat.f_files > 0 && extent.entries > stat.f_favail {
        return Err(no_room("entries", extent.entries, stat.f_favail));
    }
    if let Some(also) = also {
        let stat = rustix::fs::statvfs(also).map_err(|e| Error::Io {
            path: also.to_owned(),
            source: e.into(),
        })?;
        let free_bytes = stat.f_bavail.saturating_mul(stat.f_frsize);
        if extent.file_bytes > free_bytes {
            return Err(Error::NoRoom {
                what: format!("tree {root}"),
                path: also.to_owned(),
                unit: "bytes",
                needed: extent.file_bytes,
                free: free_bytes,
            });
        }
    }
    Ok(())
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PullReport {
    pub root: Option<Digest>,
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub logical_bytes: u64,
    pub files_written: u64,
    pub files_unchanged: u64,
    pub removed: u64,
    pub blocks_downloaded: u64,
    /// Stored (compressed) bytes fetched from the store.
    pub bytes_downloaded: u64,
    pub blocks_from_cache: u64,
}

#[derive(Default)]
struct Counters {
    files: AtomicU64,
    dirs: AtomicU64,
    symlinks: AtomicU64,
    files_written: AtomicU64,
    files_unchanged: AtomicU64,
    removed: AtomicU64,
    blocks_downloaded: AtomicU64,
    bytes_downloaded: AtomicU64,
    blocks_from_cache: AtomicU64,
}

struct Materializer<'a> {
    objects: &'a dyn Objects,
    org: &'a OrgId,
    cache: Option<Store>,
    fill_cache: bool,
    /// Every tree of the home, fetched ahead (in batches where the store
    /// reads in batches).
    known_trees: HashMap<Digest, Tree>,
    old_index: Index,
    index_dev: Option<u64>,
    progress: &'a dyn Progress,
    counters: Counters,
    new_index: Mutex<Index>,
    trees_seen: Mutex<Vec<Digest>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain collections stay valid if another worker panicked.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub fn pull(
    store: &Store,
    org: &OrgId,
    home: &HomeName,
    dest: &Path,
    options: &PullOptions,
    progress: &dyn Progress,
) -> Result<PullReport> {
    let root = store
        .read_home(org, home)?
        .ok_or_else(|| Error::NoSuchHome {
            org: org.to_string(),
            home: home.to_string(),
        })?;
    materialize(store, org, home.as_str(), &root, dest, options, progress)
}

/// Trees nested at most this deep are written on the caller's rayon pool
/// (its workers' stacks are 2 MiB by default). The writing recurses a few
/// rayon frames per level, which a debug build makes large, so a deeper
/// tree (up to [`crate::tree::DEPTH_MAX`]) gets a pool of its own with
/// [`DEEP_STACK_BYTES`] stacks: rare, and cheap next to writing such a home.
const SHALLOW_HEIGHT_MAX: usize = 48;
/// Stack of each worker writing a deep tree: room for `DEPTH_MAX` levels
/// of the writing's frames many times over. Reserved, not committed:
/// only what the recursion touches is memory.
const DEEP_STACK_BYTES: usize = 64 << 20;

fn deep_pool() -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .stack_size(DEEP_STACK_BYTES)
        .thread_name(|i| format!("roost-pull-deep-{i}"))
        .build()
        .map_err(|e| Error::Io {
            path: PathBuf::from("."),
            source: std::io::Error::other(format!("start threads for a deep tree: {e}")),
        })
}

/// Materialises the tree `root` of `objects` into `dest` (created if
/// absent; an older copy is updated in place, entries not in the tree
/// removed). `home` is recorded in the destination's index as where the
/// tree came from.
pub fn materialize(
    objects: &dyn Objects,
    org: &OrgId,
    home: &str,
    root: &Digest,
    dest: &Path,
    options: &PullOptions,
    progress: &dyn Progress,
) -> Result<PullReport> {
    std::fs::create_dir_all(dest).map_err(Error::io(dest))?;
    let dest_fd = rustix::fs::open(
        dest,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::Io {
        path: dest.to_owned(),
        source: e.into(),
    })?;
    let cache = match &options.cache {
        Some(dir) => Some(Store::unpacked(Arc::new(LocalBackend::open(dir)?))),
        None => None,
    };
    let old_index = options
        .index_path
        .as_deref()
        .map(Index::load)
        .unwrap_or_default();
    let mut materializer = Materializer {
        objects,
        org,
        cache,
        fill_cache: options.fill_cache,
        known_trees: HashMap::new(),
        old_index,
        index_dev: options.index_dev,
        progress,
        counters: Counters::default(),
        new_index: Mutex::new(Index::default()),
        trees_seen: Mutex::new(Vec::new()),
    };
    let tree = materializer.fetch_tree(root, Path::new(""), &Prefetched::new())?;
    // Every tree first, whatever the store: a tree nested too deep or
    // expanding too far (entries, file bytes, block references, tree
    // bytes) is refused before anything is written, so what the writing
    // holds per entry and per block is bounded, and so is its recursion
    // (a level per directory).
    materializer.known_trees.insert(*root, tree.clone());
    materializer.load_trees(root)?;
    let extent = crate::tree::check_bounds(root, &materializer.known_trees)?;
    if options.check_room {
        check_room(&dest_fd, dest, root, &extent, options.room_also.as_deref())?;
    }
    // Counted from the files, not from what directory entries declare.
    let logical_bytes = extent.file_bytes;
    progress.phase("downloading", Some(logical_bytes));
    // Into an empty directory from a store a round trip away: the blocks
    // in the order they are stored (no recursion: any height).
    let fresh = objects.reads_in_batches()
        && write::is_empty_dir(&dest_fd).map_err(|e| Error::Io {
            path: dest.to_owned(),
            source: e.into(),
        })?;
    let write = || materializer.materialize_dir(&dest_fd, &tree, Path::new(""), false, None);
    if fresh {
        materializer.materialize_fresh(&dest_fd, &tree)?;
    } else if extent.height > SHALLOW_HEIGHT_MAX {
        deep_pool()?.install(write)?;
    } else {
        write()?;
    }

    if let Some(path) = &options.index_path {
        let mut index = std::mem::take(&mut *lock(&materializer.new_index));
        index.last = Some(LastSync {
            store: options.store_id.clone(),
            org: org.to_string(),
            home: home.to_owned(),
            root: *root,
            trees: std::mem::take(&mut *lock(&materializer.trees_seen)),
        });
        index.save(path)?;
    }
    let n = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    let c = &materializer.counters;
    Ok(PullReport {
        root: Some(*root),
        files: n(&c.files),
        dirs: n(&c.dirs),
        symlinks: n(&c.symlinks),
        logical_bytes,
        files_written: n(&c.files_written),
        files_unchanged: n(&c.files_unchanged),
        removed: n(&c.removed),
        blocks_downloaded: n(&c.blocks_downloaded),
        bytes_downloaded: n(&c.bytes_downloaded),
        blocks_from_cache: n(&c.blocks_from_cache),
    })
}

impl Materializer<'_> {
    pub(super) fn fetch(
        &self,
        object: &ObjectId,
        rel: &Path,
        prefetched: &Prefetched,
    ) -> Result<Vec<u8>> {
        if let Some(stored) = prefetched.get(object) {
            return block::decode(&object.digest, stored).map_err(|err| {
                // Read it once more on its own: the store's own read says
                // what is wrong where it knows more (a truncated pack).
                match self.objects.get(self.org, object) {
                    Err(precise) => precise.at(rel),
                    Ok(_) => err.at(rel),
                }
            });
        }
        if let Some(cache) = &self.cache
            && let Ok(stored) = cache.get_encoded(self.org, object)
            && let Ok(plain) = block::decode(&object.digest, &stored)
        {
            self.counters
                .blocks_from_cache
                .fetch_add(1, Ordering::Relaxed);
            return Ok(plain);
        }
        let stored = self
            .objects
            .get(self.org, object)
            .and_then(|stored| {
                stored.ok_or(Error::MissingObject {
                    digest: object.digest,
                    path: None,
                })
            })
            .map_err(|e| e.at(rel))?;
        let plain = block::decode(&object.digest, &stored).map_err(|e| e.at(rel))?;
        self.downloaded(object, &stored);
        Ok(plain)
    }

    /// Calls `write` with the verified content of the block `digest`,
    /// which must be `len` bytes. A block a window fetched ahead is
    /// decoded without an allocation of its own (see [`block::decode_in`]):
    /// into a buffer this thread keeps (at most a block, 8 MiB, for the
    /// thread's life), or, stored plain, read in place.
    pub(super) fn with_block(
        &self,
        digest: &Digest,
        len: u64,
        rel: &Path,
        prefetched: &Prefetched,
        write: impl FnOnce(&[u8]) -> Result<()>,
    ) -> Result<()> {
        thread_local! {
            static BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let object = ObjectId::block(*digest);
        let check = |data: &[u8]| -> Result<()> {
            if data.len() as u64 == len {
                return Ok(());
            }
            Err(Error::Corrupt {
                digest: *digest,
                path: Some(rel.to_owned()),
                reason: crate::Corruption::LengthMismatch {
                    expected: len,
                    found: data.len() as u64,
                },
            })
        };
        if let Some(stored) = prefetched.get(&object) {
            return BUFFER.with(|buffer| {
                let mut buffer = buffer.borrow_mut();
                let data = match block::decode_in(digest, stored, &mut buffer) {
                    Ok(data) => data,
                    // The precise reason, as `fetch` gives it.
                    Err(err) => {
                        return Err(match self.fetch(&object, rel, prefetched) {
                            Err(precise) => precise,
                            Ok(_) => err.at(rel),
                        });
                    }
                };
                check(data)?;
                write(data)
            });
        }
        let data = self.fetch(&object, rel, prefetched)?;
        check(&data)?;
        write(&data)
    }

    /// Counts an object that came from the store, and keeps it in the block
    /// cache when this pull fills it.
    fn downloaded(&self, object: &ObjectId, stored: &[u8]) {
        self.counters
            .blocks_downloaded
            .fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes_downloaded
            .fetch_add(stored.len() as u64, Ordering::Relaxed);
        if let Some(cache) = &self.cache
            && self.fill_cache
            // A failed cache write only costs a later download.
            && let Err(err) = cache.put_batch(self.org, &[(*object, stored)])
        {
            tracing::warn!(%err, "block cache write failed");
        }
    }

    /// Fetches `objects` (those the block cache lacks) in one batch.
    pub(super) fn prefetch(&self, mut objects: Vec<ObjectId>, rel: &Path) -> Result<Prefetched> {
        objects.sort_unstable();
        objects.dedup();
        if let Some(cache) = &self.cache
            && !objects.is_empty()
        {
            // An unreadable cache only costs downloads.
            if let Ok(absent) = cache.missing(self.org, &objects) {
                objects = absent;
            }
        }
        if objects.is_empty() {
            return Ok(Prefetched::new());
        }
        let fetched = self
            .objects
            .get_batch(self.org, &objects)
            .map_err(|e| e.at(rel))?;
        let mut prefetched = Prefetched::with_capacity(objects.len());
        for (object, stored) in objects.into_iter().zip(fetched) {
            // Absent: its own read, where it is used, names it at its path.
            let Some(stored) = stored else { continue };
            self.downloaded(&object, &stored);
            prefetched.insert(object, stored);
        }
        Ok(prefetched)
    }

    /// [`Materializer::prefetch`] handing each object on as it arrives
    /// ([`Objects::get_batch_each`]): `each` gets every one of `objects`
    /// once, with its stored bytes, or `None` when the block cache holds
    /// it or the store lacks it (its own read, where it is used, then
    /// reads the cache or names it at its path).
    ///
    /// `objects` are asked for in the order given (the first of any
    /// repeated), which is the order a store that does not sort by
    /// location (the block service) hands them back in: the caller's
    /// order, a fresh pull's walk, keeps each part it writes within a few
    /// directories. (In hash order each part spread over every directory
    /// of its window; the 2 GiB benchmark home's fresh wake did not
    /// measurably change either way, BENCHMARKS.md "Packs".)
    ///
    /// [`Objects::get_batch_each`]: crate::objects::Objects::get_batch_each
    pub(super) fn prefetch_each(
        &self,
        mut objects: Vec<ObjectId>,
        each: &mut dyn FnMut(ObjectId, Option<Vec<u8>>) -> Result<()>,
    ) -> Result<()> {
        let mut seen = HashSet::with_capacity(objects.len());
        objects.retain(|object| seen.insert(*object));
        if let Some(cache) = &self.cache
            && !objects.is_empty()
        {
            // An unreadable cache only costs downloads.
            if let Ok(absent) = cache.missing(self.org, &objects) {
                let absent: HashSet<ObjectId> = absent.into_iter().collect();
                for cached in objects.iter().filter(|o| !absent.contains(o)) {
                    each(*cached, None)?;
                }
                objects.retain(|object| absent.contains(object));
            }
        }
        self.objects
            .get_batch_each(self.org, &objects, &mut |i, stored| {
                let object = objects[i];
                if let Some(stored) = &stored {
                    self.downloaded(&object, stored);
                }
                each(object, stored)
            })
    }

    pub(super) fn fetch_tree(
        &self,
        digest: &Digest,
        rel: &Path,
        prefetched: &Prefetched,
    ) -> Result<Tree> {
        if let Some(tree) = self.known_trees.get(digest) {
            lock(&self.trees_seen).push(*digest);
            return Ok(tree.clone());
        }
        let bytes = self.fetch(&ObjectId::tree(*digest), rel, prefetched)?;
        lock(&self.trees_seen).push(*digest);
        Tree::decode(digest, &bytes)
    }
}
