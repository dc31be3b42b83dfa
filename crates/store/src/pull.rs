//! Pull: materialise a home's tree into a directory.
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
//! cost a round trip (the block service,
//! [`crate::backend::Backend::reads_in_batches`]), every tree is fetched
//! first, a level at a time, and then the blocks of small files come in
//! windows: a directory's own files, or whole subtrees this pull creates,
//! several per window, so a home of many small directories takes few
//! requests.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, Timespec, Timestamps};

use crate::backend::LocalBackend;
use crate::block::{SPLIT_BLOCK_BYTES, block_ranges};
use crate::index::{Index, IndexKey, LastSync, timestamp_ns};
use crate::progress::Progress;
use crate::store::ObjectId;
use crate::tree::{Entry, EntryKind, Tree};
use crate::{Digest, Error, HomeName, OrgId, Result, Store, block};

const TEMP_PREFIX: &str = ".roost-tmp-";

/// Files up to this size have their blocks fetched with their directory's
/// window when the store reads in batches; larger ones block by block.
const PREFETCH_FILE_BYTES_MAX: u64 = 1024 * 1024;
/// A window of files holds at most this many objects...
const PREFETCH_WINDOW_OBJECTS: usize = 1024;
/// ...and this many bytes of content: what one window holds in memory.
const PREFETCH_WINDOW_BYTES: u64 = 16 * 1024 * 1024;
/// Entries looked at to size a subtree before it counts as too large for
/// a window (trees may share subtrees; this bounds the walk).
const PREFETCH_SUBTREE_ENTRIES_MAX: usize = 4 * PREFETCH_WINDOW_OBJECTS;

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
    store: &'a Store,
    org: &'a OrgId,
    cache: Option<Store>,
    fill_cache: bool,
    /// Every tree of the home, fetched ahead (from a store that reads in
    /// batches); empty otherwise.
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

/// Materialises the tree `root` into `dest` (created if absent; an older
/// copy is updated in place, entries not in the tree removed). `home`
/// is recorded in the destination's index as where the tree came from.
pub fn materialize(
    store: &Store,
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
        Some(dir) => Some(Store::new(Arc::new(LocalBackend::open(dir)?))),
        None => None,
    };
    let old_index = options
        .index_path
        .as_deref()
        .map(Index::load)
        .unwrap_or_default();
    let mut materializer = Materializer {
        store,
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
    if store.backend().reads_in_batches() {
        materializer.load_trees(&tree)?;
    }
    let logical_bytes = crate::tree::logical_bytes(&tree.entries);
    progress.phase("downloading", Some(logical_bytes));
    materializer.materialize_dir(&dest_fd, &tree, Path::new(""), false, None)?;

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

fn zero_block_digest() -> &'static Digest {
    static ZERO: OnceLock<Digest> = OnceLock::new();
    ZERO.get_or_init(|| Digest::of(&vec![0u8; SPLIT_BLOCK_BYTES as usize]))
}

fn io_at(path: &Path) -> impl FnOnce(rustix::io::Errno) -> Error + '_ {
    move |errno| Error::Io {
        path: path.to_owned(),
        source: errno.into(),
    }
}

/// What `entry`'s name in `dir` holds now: nothing in a directory this
/// pull created.
fn existing_entry(
    dir: &OwnedFd,
    entry: &Entry,
    parent_rel: &Path,
    created: bool,
) -> Result<Option<rustix::fs::Stat>> {
    if created {
        return Ok(None);
    }
    let name = OsStr::from_bytes(&entry.name);
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => Ok(Some(stat)),
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(errno) => Err(io_at(&parent_rel.join(name))(errno)),
    }
}

fn timestamps(mtime_ns: i64) -> Timestamps {
    let time = Timespec {
        tv_sec: mtime_ns.div_euclid(1_000_000_000),
        tv_nsec: mtime_ns.rem_euclid(1_000_000_000) as _,
    };
    Timestamps {
        last_access: time,
        last_modification: time,
    }
}

impl Materializer<'_> {
    fn fetch(&self, object: &ObjectId, rel: &Path, prefetched: &Prefetched) -> Result<Vec<u8>> {
        if let Some(stored) = prefetched.get(object) {
            return block::decode(&object.digest, stored).map_err(|e| e.at(rel));
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
            .store
            .get_encoded(self.org, object)
            .map_err(|e| e.at(rel))?;
        let plain = block::decode(&object.digest, &stored).map_err(|e| e.at(rel))?;
        self.downloaded(object, &stored);
        Ok(plain)
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
            && let Err(err) = cache
                .backend()
                .put(&Store::object_key(self.org, object), stored)
        {
            tracing::warn!(%err, "block cache write failed");
        }
    }

    /// Fetches `objects` (those the block cache lacks) in one batch.
    fn prefetch(&self, mut objects: Vec<ObjectId>, rel: &Path) -> Result<Prefetched> {
        objects.sort_unstable();
        objects.dedup();
        if let Some(cache) = &self.cache
            && !objects.is_empty()
        {
            let keys: Vec<String> = objects
                .iter()
                .map(|o| Store::object_key(self.org, o))
                .collect();
            // An unreadable cache only costs downloads.
            if let Ok(present) = cache.backend().exists(&keys) {
                objects = objects
                    .into_iter()
                    .zip(present)
                    .filter_map(|(object, present)| (!present).then_some(object))
                    .collect();
            }
        }
        if objects.is_empty() {
            return Ok(Prefetched::new());
        }
        let fetched = self
            .store
            .get_encoded_batch(self.org, &objects)
            .map_err(|e| e.at(rel))?;
        let mut prefetched = Prefetched::with_capacity(objects.len());
        for (object, stored) in objects.into_iter().zip(fetched) {
            let stored = stored.ok_or_else(|| {
                Error::MissingObject {
                    digest: object.digest,
                    path: None,
                }
                .at(rel)
            })?;
            self.downloaded(&object, &stored);
            prefetched.insert(object, stored);
        }
        Ok(prefetched)
    }

    /// Fetches every tree under `root` into `known_trees`, a level at a
    /// time, each level in as few requests as the batch size allows.
    fn load_trees(&mut self, root: &Tree) -> Result<()> {
        let subdirs = |tree: &Tree, rel: &Path| -> Vec<(Digest, PathBuf)> {
            tree.entries
                .iter()
                .filter_map(|entry| match &entry.kind {
                    EntryKind::Dir { tree } => {
                        Some((*tree, rel.join(OsStr::from_bytes(&entry.name))))
                    }
                    _ => None,
                })
                .collect()
        };
        let mut level = subdirs(root, Path::new(""));
        while !level.is_empty() {
            level.sort_unstable_by_key(|(digest, _)| *digest);
            level.dedup_by_key(|(digest, _)| *digest);
            level.retain(|(digest, _)| !self.known_trees.contains_key(digest));
            let objects = level.iter().map(|(d, _)| ObjectId::tree(*d)).collect();
            let prefetched = self.prefetch(objects, Path::new(""))?;
            let mut next = Vec::new();
            for (digest, rel) in level {
                let bytes = self.fetch(&ObjectId::tree(digest), &rel, &prefetched)?;
                let tree = Tree::decode(&digest, &bytes).map_err(|e| e.at(&rel))?;
                next.extend(subdirs(&tree, &rel));
                self.known_trees.insert(digest, tree);
            }
            level = next;
        }
        Ok(())
    }

    fn fetch_tree(&self, digest: &Digest, rel: &Path, prefetched: &Prefetched) -> Result<Tree> {
        if let Some(tree) = self.known_trees.get(digest) {
            lock(&self.trees_seen).push(*digest);
            return Ok(tree.clone());
        }
        let bytes = self.fetch(&ObjectId::tree(*digest), rel, prefetched)?;
        lock(&self.trees_seen).push(*digest);
        Tree::decode(digest, &bytes)
    }

    /// `created` says we made `dir` in this pull, so it holds nothing of
    /// its own yet (an existing directory is listed and compared instead).
    /// `inherited` holds the small files' blocks of this whole subtree,
    /// fetched by an ancestor (only for a directory this pull created).
    fn materialize_dir(
        &self,
        dir: &OwnedFd,
        tree: &Tree,
        rel: &Path,
        created: bool,
        inherited: Option<&Prefetched>,
    ) -> Result<()> {
        self.counters.dirs.fetch_add(1, Ordering::Relaxed);
        if !created {
            let wanted: HashSet<&[u8]> = tree.entries.iter().map(|e| e.name.as_slice()).collect();
            for name in list_names(dir).map_err(io_at(rel))? {
                if !wanted.contains(name.as_slice()) {
                    remove_entry(dir, &name).map_err(io_at(&rel.join(OsStr::from_bytes(&name))))?;
                    self.counters.removed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if !self.store.backend().reads_in_batches() {
            return tree.entries.par_iter().try_for_each(|entry| {
                let existing = existing_entry(dir, entry, rel, created)?;
                self.materialize_entry(dir, entry, existing.as_ref(), rel, &Prefetched::new(), None)
            });
        }
        let entries: Vec<(&Entry, Option<rustix::fs::Stat>)> = tree
            .entries
            .par_iter()
            .map(|entry| Ok((entry, existing_entry(dir, entry, rel, created)?)))
            .collect::<Result<_>>()?;
        let (dirs, others): (Vec<_>, Vec<_>) = entries
            .into_iter()
            .partition(|(entry, _)| matches!(entry.kind, EntryKind::Dir { .. }));
        if let Some(prefetched) = inherited {
            return others
                .iter()
                .chain(&dirs)
                .par_bridge()
                .try_for_each(|(entry, existing)| {
                    self.materialize_entry(
                        dir,
                        entry,
                        existing.as_ref(),
                        rel,
                        prefetched,
                        inherited,
                    )
                });
        }
        // Files first, a window at a time, so that one directory holds at
        // most a window's blocks while its subdirectories are worked on.
        for (window, objects) in self.file_windows(&others) {
            let prefetched = self.prefetch(objects, rel)?;
            others[window]
                .par_iter()
                .try_for_each(|(entry, existing)| {
                    self.materialize_entry(dir, entry, existing.as_ref(), rel, &prefetched, None)
                })?;
        }
        // Then subdirectories: whole subtrees this pull creates, several to
        // a window; one too large for a window, or one already here (its
        // files are compared first), works through its own.
        for (group, objects, whole) in self.subtree_groups(&dirs) {
            let prefetched = self.prefetch(objects, rel)?;
            let inherited = whole.then_some(&prefetched);
            dirs[group].par_iter().try_for_each(|(entry, existing)| {
                self.materialize_entry(dir, entry, existing.as_ref(), rel, &prefetched, inherited)
            })?;
        }
        Ok(())
    }

    /// Splits a directory's subdirectories into runs: those this pull
    /// creates whose subtrees' small-file blocks fit a window together
    /// (`true`, with those blocks), and one at a time the rest (`false`).
    fn subtree_groups(
        &self,
        dirs: &[(&Entry, Option<rustix::fs::Stat>)],
    ) -> Vec<(std::ops::Range<usize>, Vec<ObjectId>, bool)> {
        let mut groups = Vec::new();
        let (mut start, mut objects, mut bytes) = (0, Vec::new(), 0);
        for (i, (entry, existing)) in dirs.iter().enumerate() {
            let created =
                existing.map(|s| FileType::from_raw_mode(s.st_mode)) != Some(FileType::Directory);
            let sized = match &entry.kind {
                EntryKind::Dir { tree } if created => self.subtree_blocks(tree),
                _ => None,
            };
            let Some((more, more_bytes)) = sized else {
                if start < i {
                    groups.push((start..i, std::mem::take(&mut objects), true));
                }
                groups.push((i..i + 1, Vec::new(), false));
                (start, bytes) = (i + 1, 0);
                continue;
            };
            if objects.len() + more.len() > PREFETCH_WINDOW_OBJECTS
                || bytes + more_bytes > PREFETCH_WINDOW_BYTES
            {
                if start < i {
                    groups.push((start..i, std::mem::take(&mut objects), true));
                }
                (start, bytes) = (i, 0);
            }
            objects.extend(more);
            bytes += more_bytes;
        }
        if start < dirs.len() {
            groups.push((start..dirs.len(), objects, true));
        }
        groups
    }

    /// The blocks of every small file under the tree `root` and their
    /// bytes, if they fit one window (`None` if not, or if a tree is not
    /// known).
    fn subtree_blocks(&self, root: &Digest) -> Option<(Vec<ObjectId>, u64)> {
        let (mut objects, mut bytes, mut seen) = (Vec::new(), 0, 0);
        let mut stack = vec![root];
        while let Some(digest) = stack.pop() {
            for entry in &self.known_trees.get(digest)?.entries {
                seen += 1;
                match &entry.kind {
                    EntryKind::Dir { tree } => stack.push(tree),
                    EntryKind::File { blocks } if entry.size <= PREFETCH_FILE_BYTES_MAX => {
                        objects.extend(blocks.iter().map(|d| ObjectId::block(*d)));
                        bytes += entry.size;
                    }
                    _ => {}
                }
            }
            if objects.len() > PREFETCH_WINDOW_OBJECTS
                || bytes > PREFETCH_WINDOW_BYTES
                || seen > PREFETCH_SUBTREE_ENTRIES_MAX
            {
                return None;
            }
        }
        Some((objects, bytes))
    }

    /// Splits a directory's non-directory entries into windows, each with
    /// the objects its small files that need writing will read.
    fn file_windows(
        &self,
        entries: &[(&Entry, Option<rustix::fs::Stat>)],
    ) -> Vec<(std::ops::Range<usize>, Vec<ObjectId>)> {
        let mut windows = Vec::new();
        let (mut start, mut objects, mut bytes) = (0, Vec::new(), 0);
        for (i, (entry, existing)) in entries.iter().enumerate() {
            if let EntryKind::File { blocks } = &entry.kind
                && entry.size <= PREFETCH_FILE_BYTES_MAX
                && self.unchanged(existing.as_ref(), blocks).is_none()
            {
                objects.extend(blocks.iter().map(|digest| ObjectId::block(*digest)));
                bytes += entry.size;
            }
            if objects.len() >= PREFETCH_WINDOW_OBJECTS || bytes >= PREFETCH_WINDOW_BYTES {
                windows.push((start..i + 1, std::mem::take(&mut objects)));
                (start, bytes) = (i + 1, 0);
            }
        }
        if start < entries.len() {
            windows.push((start..entries.len(), objects));
        }
        windows
    }

    /// The stat of a file already holding exactly `blocks` (by the old
    /// index), which then needs at most its mode and mtime touched up.
    fn unchanged<'s>(
        &self,
        existing: Option<&'s rustix::fs::Stat>,
        blocks: &[Digest],
    ) -> Option<&'s rustix::fs::Stat> {
        existing.filter(|stat| {
            FileType::from_raw_mode(stat.st_mode) == FileType::RegularFile
                && stat.st_nlink == 1
                && self
                    .old_index
                    .files
                    .get(&self.index_key(stat))
                    .map(Vec::as_slice)
                    == Some(blocks)
        })
    }

    /// `existing` is what the entry's name holds now, if anything.
    fn materialize_entry(
        &self,
        dir: &OwnedFd,
        entry: &Entry,
        existing: Option<&rustix::fs::Stat>,
        parent_rel: &Path,
        prefetched: &Prefetched,
        inherited: Option<&Prefetched>,
    ) -> Result<()> {
        let name = OsStr::from_bytes(&entry.name);
        let rel = parent_rel.join(name);
        let existing_type = existing.map(|s| FileType::from_raw_mode(s.st_mode));
        match &entry.kind {
            EntryKind::Dir { tree } => {
                let created = existing_type != Some(FileType::Directory);
                if created {
                    if existing_type.is_some() {
                        remove_entry(dir, &entry.name).map_err(io_at(&rel))?;
                    }
                    rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o700))
                        .map_err(io_at(&rel))?;
                }
                let child = rustix::fs::openat(
                    dir,
                    name,
                    OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(io_at(&rel))?;
                if !created {
                    ensure_writable_dir(&child).map_err(io_at(&rel))?;
                }
                let subtree = self.fetch_tree(tree, &rel, prefetched)?;
                let inherited = inherited.filter(|_| created);
                self.materialize_dir(&child, &subtree, &rel, created, inherited)?;
                rustix::fs::fchmod(&child, Mode::from_raw_mode(entry.mode)).map_err(io_at(&rel))?;
                rustix::fs::futimens(&child, &timestamps(entry.mtime_ns)).map_err(io_at(&rel))?;
            }
            EntryKind::File { blocks } => {
                self.counters.files.fetch_add(1, Ordering::Relaxed);
                if let Some(stat) = self.unchanged(existing, blocks) {
                    self.touch_up(dir, name, entry, stat, &rel)?;
                    self.counters
                        .files_unchanged
                        .fetch_add(1, Ordering::Relaxed);
                    self.progress.advance(entry.size);
                    return Ok(());
                }
                if existing_type == Some(FileType::Directory) {
                    remove_entry(dir, &entry.name).map_err(io_at(&rel))?;
                }
                self.write_file(dir, name, entry, blocks, &rel, prefetched)?;
                self.counters.files_written.fetch_add(1, Ordering::Relaxed);
            }
            EntryKind::Symlink { target } => {
                self.counters.symlinks.fetch_add(1, Ordering::Relaxed);
                if existing_type == Some(FileType::Directory) {
                    remove_entry(dir, &entry.name).map_err(io_at(&rel))?;
                }
                let temp = temp_name(&entry.name);
                rustix::fs::symlinkat(OsStr::from_bytes(target), dir, &temp)
                    .map_err(io_at(&rel))?;
                if let Err(errno) = rustix::fs::renameat(dir, &temp, dir, name) {
                    let _ = rustix::fs::unlinkat(dir, &temp, AtFlags::empty());
                    return Err(io_at(&rel)(errno));
                }
                rustix::fs::utimensat(
                    dir,
                    name,
                    &timestamps(entry.mtime_ns),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(io_at(&rel))?;
            }
        }
        Ok(())
    }

    /// Content already right: only mode and mtime may need fixing.
    fn touch_up(
        &self,
        dir: &OwnedFd,
        name: &OsStr,
        entry: &Entry,
        stat: &rustix::fs::Stat,
        rel: &Path,
    ) -> Result<()> {
        if stat.st_mode & 0o7777 != entry.mode || self.index_key(stat).mtime_ns != entry.mtime_ns {
            let fd = rustix::fs::openat(
                dir,
                name,
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(io_at(rel))?;
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(entry.mode)).map_err(io_at(rel))?;
            rustix::fs::futimens(&fd, &timestamps(entry.mtime_ns)).map_err(io_at(rel))?;
            let changed = rustix::fs::fstat(&fd).map_err(io_at(rel))?;
            self.record_index(&changed, entry);
        } else {
            self.record_index(stat, entry);
        }
        Ok(())
    }

    fn write_file(
        &self,
        dir: &OwnedFd,
        name: &OsStr,
        entry: &Entry,
        blocks: &[Digest],
        rel: &Path,
        prefetched: &Prefetched,
    ) -> Result<()> {
        let temp = temp_name(&entry.name);
        let fd = rustix::fs::openat(
            dir,
            &temp,
            OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(io_at(rel))?;
        let result = (|| -> Result<File> {
            let mut file = File::from(fd);
            let split = entry.size > crate::block::SINGLE_BLOCK_BYTES_MAX;
            let mut ends_in_hole = false;
            for ((offset, len), digest) in block_ranges(entry.size).zip(blocks) {
                ends_in_hole = split && digest == zero_block_digest();
                if ends_in_hole {
                    // A hole reads back as zeros: keep sparse files sparse.
                    file.seek(SeekFrom::Start(offset + len))
                        .map_err(Error::io(rel))?;
                } else {
                    let data = self.fetch(&ObjectId::block(*digest), rel, prefetched)?;
                    if data.len() as u64 != len {
                        return Err(Error::Corrupt {
                            digest: *digest,
                            path: Some(rel.to_owned()),
                        });
                    }
                    file.write_all(&data).map_err(Error::io(rel))?;
                }
                self.progress.advance(len);
            }
            if ends_in_hole {
                file.set_len(entry.size).map_err(Error::io(rel))?;
            }
            rustix::fs::fchmod(file.as_fd(), Mode::from_raw_mode(entry.mode))
                .map_err(io_at(rel))?;
            rustix::fs::futimens(file.as_fd(), &timestamps(entry.mtime_ns)).map_err(io_at(rel))?;
            rustix::fs::renameat(dir, &temp, dir, name).map_err(io_at(rel))?;
            Ok(file)
        })();
        if result.is_err() {
            let _ = rustix::fs::unlinkat(dir, &temp, AtFlags::empty());
        }
        // The handle still names the file after the rename; its ctime now
        // includes the rename.
        let stat = rustix::fs::fstat(result?).map_err(io_at(rel))?;
        self.record_index(&stat, entry);
        Ok(())
    }

    /// Remember what we wrote so the next push of this directory need not
    /// read it again. Unlike a scan, the racy-timestamp rule is not applied:
    /// we wrote this content ourselves and stat it after our last change,
    /// and the kernel gives a change made after a stat a distinct ctime
    /// (multigrain timestamps, Linux 6.13+). On older kernels a write by
    /// someone else within the same few-millisecond tick as our own last
    /// write, racing the pull, could go unnoticed by the next push.
    fn record_index(&self, stat: &rustix::fs::Stat, entry: &Entry) {
        if let EntryKind::File { blocks } = &entry.kind {
            lock(&self.new_index)
                .files
                .insert(self.index_key(stat), blocks.clone());
        }
    }

    fn index_key(&self, stat: &rustix::fs::Stat) -> IndexKey {
        let mut key = index_key(stat);
        if let Some(dev) = self.index_dev {
            key.dev = dev;
        }
        key
    }
}

fn index_key(stat: &rustix::fs::Stat) -> IndexKey {
    IndexKey {
        dev: stat.st_dev,
        ino: stat.st_ino,
        size: stat.st_size as u64,
        mtime_ns: timestamp_ns(stat.st_mtime, stat.st_mtime_nsec as i64),
        ctime_ns: timestamp_ns(stat.st_ctime, stat.st_ctime_nsec as i64),
    }
}

fn temp_name(name: &[u8]) -> std::ffi::OsString {
    use std::sync::atomic::AtomicU64;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tag = &Digest::of(name).to_hex()[..8];
    std::ffi::OsString::from(format!("{TEMP_PREFIX}{}-{n}-{tag}", std::process::id()))
}

fn list_names(dir: &OwnedFd) -> rustix::io::Result<Vec<Vec<u8>>> {
    let mut names = Vec::new();
    let mut iter = rustix::fs::Dir::read_from(dir)?;
    while let Some(entry) = iter.read() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
    Ok(names)
}

/// An older copy may hold read-only directories (Go's module cache makes
/// them): give ourselves write and search access while we work inside;
/// the final `fchmod` restores the snapshot's mode.
fn ensure_writable_dir(dir: &OwnedFd) -> rustix::io::Result<()> {
    let mode = rustix::fs::fstat(dir)?.st_mode & 0o7777;
    if mode & 0o700 != 0o700 {
        rustix::fs::fchmod(dir, Mode::from_raw_mode(mode | 0o700))?;
    }
    Ok(())
}

/// Removes a file, symlink or whole directory tree without following links.
fn remove_entry(dir: &OwnedFd, name: &[u8]) -> rustix::io::Result<()> {
    let name = OsStr::from_bytes(name);
    let stat = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => stat,
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(errno) => return Err(errno),
    };
    if FileType::from_raw_mode(stat.st_mode) == FileType::Directory {
        let child = rustix::fs::openat(
            dir,
            name,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        ensure_writable_dir(&child)?;
        for grandchild in list_names(&child)? {
            remove_entry(&child, &grandchild)?;
        }
        rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)
    } else {
        rustix::fs::unlinkat(dir, name, AtFlags::empty())
    }
}
