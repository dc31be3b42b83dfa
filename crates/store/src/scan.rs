//! Scanning a home: walk the directory a level at a time in parallel,
//! reuse block digests of unchanged files from the index, hash the rest,
//! and build the Merkle tree bottom-up, without recursion. Nothing is
//! uploaded here.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::block::{block_count, block_ranges};
use crate::excludes::Excludes;
use crate::index::{FileMap, Index, IndexKey, KeyRule, mtime_ns};
use crate::progress::Progress;
use crate::tree::{
    DEPTH_MAX, Entry, EntryKind, Extent, FILE_BYTES_MAX, SETID_BITS, Tree, stored_mode,
};
use crate::{Digest, Error, Result};

/// Attempts at hashing a file that keeps changing under us.
const HASH_ATTEMPTS_MAX: usize = 3;

pub(crate) struct TreeNode {
    /// The tree's encoding: in memory, or set aside on disk for the
    /// upload ([`Collected::set_trees_aside`]).
    pub(crate) bytes: TreeBytes,
    /// The directory this tree was scanned from: where its files' blocks
    /// are read again if they have to be uploaded.
    pub dir: Arc<PathBuf>,
    pub subtrees: Vec<Digest>,
    pub blocks: Vec<Digest>,
}

pub(crate) enum TreeBytes {
    Held(Vec<u8>),
    /// In [`Collected::aside`] at this offset, this long.
    Aside {
        offset: u64,
        len: u32,
    },
}

impl TreeNode {
    /// The length of the tree's encoding.
    pub fn len(&self) -> u64 {
        match &self.bytes {
            TreeBytes::Held(bytes) => bytes.len() as u64,
            TreeBytes::Aside { len, .. } => u64::from(*len),
        }
    }
}

/// Where to read a block's content again when it has to be uploaded: a
/// file of a scanned directory, named by places rather than by a path of
/// its own (a 100k-file home kept a path per file alive for its whole
/// upload).
#[derive(Clone, Copy)]
pub(crate) struct BlockAt {
    pub digest: Digest,
    /// The directory: an index into [`BlockSources::dirs`].
    pub dir: u32,
    /// The file: an index into the directory's tree entries.
    pub entry: u32,
    pub offset: u64,
    pub len: u64,
}

/// The blocks an upload reads ([`Collected::block_sources`]), grouped by
/// directory, and the directories they are read from.
pub(crate) struct BlockSources<'a> {
    collected: &'a Collected,
    pub dirs: Vec<(&'a Digest, &'a TreeNode)>,
    pub blocks: Vec<BlockAt>,
}

impl BlockSources<'_> {
    /// `at`'s file path. `decoded` caches the last directory's tree:
    /// blocks come grouped by directory, so a batch decodes each of its
    /// directories once.
    pub fn path(&self, at: &BlockAt, decoded: &mut Option<(u32, Tree)>) -> Result<PathBuf> {
        let (digest, node) = self.dirs[at.dir as usize];
        if decoded.as_ref().is_none_or(|(dir, _)| *dir != at.dir) {
            let bytes = self.collected.tree_bytes(node)?;
            *decoded = Some((at.dir, Tree::decode(digest, &bytes)?));
        }
        let entry = decoded
            .as_ref()
            .and_then(|(_, tree)| tree.entries.get(at.entry as usize))
            .ok_or(Error::MissingObject {
                digest: at.digest,
                path: Some(node.dir.to_path_buf()),
            })?;
        Ok(node.dir.join(std::ffi::OsStr::from_bytes(&entry.name)))
    }
}

#[derive(Default)]
pub(crate) struct Collected {
    pub trees: HashMap<Digest, TreeNode>,
    pub index_files: FileMap<Vec<Digest>>,
    /// The unnamed temporary file the trees' encodings were set aside in
    /// (and the directory it is in, for errors), if they were.
    aside: Option<(fs::File, PathBuf)>,
}

impl Collected {
    /// Moves every tree's encoding out of memory into an unnamed
    /// temporary file in `dir` (gone with the process, however it ends):
    /// an upload then holds its packs without the home's trees beside
    /// them (~15 MB at 100k files, an eighth of its peak), and reads each
    /// tree back when it goes up. Where no such file can be made there,
    /// the trees stay in memory: a push costs memory rather than fail.
    pub fn set_trees_aside(&mut self, dir: &Path) {
        if self.aside.is_some() {
            return;
        }
        let write = |trees: &mut HashMap<Digest, TreeNode>| -> std::io::Result<fs::File> {
            let mut writer =
                std::io::BufWriter::with_capacity(256 * 1024, crate::index::unnamed_file_in(dir)?);
            // Written first, switched after: a failed write leaves every
            // tree held.
            let mut offset = 0u64;
            let mut places = Vec::with_capacity(trees.len());
            for (digest, node) in trees.iter() {
                if let TreeBytes::Held(bytes) = &node.bytes {
                    std::io::Write::write_all(&mut writer, bytes)?;
                    places.push((*digest, offset, bytes.len() as u32));
                    offset += bytes.len() as u64;
                }
            }
            let file = writer.into_inner().map_err(|e| e.into_error())?;
            for (digest, offset, len) in places {
                if let Some(node) = trees.get_mut(&digest) {
                    node.bytes = TreeBytes::Aside { offset, len };
                }
            }
            Ok(file)
        };
        match write(&mut self.trees) {
            Ok(file) => self.aside = Some((file, dir.to_owned())),
            Err(err) => {
                tracing::debug!(dir = %dir.display(), %err, "cannot set the trees aside; keeping them in memory");
            }
        }
    }

    /// `node`'s encoding, read back if it was set aside.
    pub fn tree_bytes<'a>(&self, node: &'a TreeNode) -> Result<std::borrow::Cow<'a, [u8]>> {
        match &node.bytes {
            TreeBytes::Held(bytes) => Ok(std::borrow::Cow::Borrowed(bytes)),
            TreeBytes::Aside { offset, len } => {
                let Some((file, dir)) = &self.aside else {
                    return Err(Error::Io {
                        path: PathBuf::new(),
                        source: std::io::Error::other("a tree set aside without its file"),
                    });
                };
                let mut bytes = vec![0u8; *len as usize];
                std::os::unix::fs::FileExt::read_exact_at(file, &mut bytes, *offset)
                    .map_err(Error::io(dir))?;
                Ok(std::borrow::Cow::Owned(bytes))
            }
        }
    }

    /// Where to read each of `wanted` blocks (sorted, no duplicates),
    /// each once, grouped by directory: found by walking the trees from
    /// `root` a level at a time, only when an upload needs them (an
    /// unchanged push never pays for it). The walk's order is the order
    /// the blocks go up in: the same for the same home (not a hash map's,
    /// which differs per process), and the order a pull into an empty
    /// directory first needs them.
    pub fn block_sources(&self, root: &Digest, wanted: &[Digest]) -> Result<BlockSources<'_>> {
        let mut claimed = vec![false; wanted.len()];
        let mut sources = BlockSources {
            collected: self,
            dirs: Vec::new(),
            blocks: Vec::with_capacity(wanted.len()),
        };
        let mut walked: HashSet<&Digest> = HashSet::new();
        let mut queue: std::collections::VecDeque<&Digest> = [root].into();
        while let Some(digest) = queue.pop_front() {
            let Some((digest, node)) = self.trees.get_key_value(digest) else {
                continue;
            };
            if !walked.insert(digest) {
                continue;
            }
            queue.extend(node.subtrees.iter());
            let unclaimed = |block: &Digest| wanted.binary_search(block).is_ok_and(|i| !claimed[i]);
            if !node.blocks.iter().any(unclaimed) {
                continue;
            }
            // The scan encoded it: only reading it back can fail.
            let Ok(tree) = Tree::decode(digest, &self.tree_bytes(node)?) else {
                continue;
            };
            let dir = sources.dirs.len() as u32;
            sources.dirs.push((digest, node));
            for (entry_index, entry) in tree.entries.into_iter().enumerate() {
                let EntryKind::File { blocks } = entry.kind else {
                    continue;
                };
                for ((offset, len), block) in block_ranges(entry.size).zip(blocks) {
                    if let Ok(i) = wanted.binary_search(&block)
                        && !claimed[i]
                    {
                        claimed[i] = true;
                        sources.blocks.push(BlockAt {
                            digest: block,
                            dir,
                            entry: entry_index as u32,
                            offset,
                            len,
                        });
                    }
                }
            }
        }
        Ok(sources)
    }

    pub fn all_blocks(&self) -> HashSet<Digest> {
        self.trees
            .values()
            .flat_map(|node| node.blocks.iter().copied())
            .collect()
    }
}

#[derive(Default)]
pub(crate) struct ScanStats {
    pub files: AtomicU64,
    pub dirs: AtomicU64,
    pub symlinks: AtomicU64,
    pub special_skipped: AtomicU64,
    pub excluded: AtomicU64,
    pub bytes_scanned: AtomicU64,
    pub files_hashed: AtomicU64,
    pub bytes_hashed: AtomicU64,
    /// Entries whose setuid or setgid bits were cleared (trees never carry
    /// them: see [`crate::tree`]).
    pub setid_stripped: AtomicU64,
}

pub(crate) struct Scan {
    pub root: Digest,
    pub logical_bytes: u64,
    pub collected: Collected,
    pub stats: ScanStats,
}

struct Scanner<'a> {
    excludes: &'a Excludes,
    old: &'a Index,
    rule: KeyRule,
    progress: &'a dyn Progress,
    stats: ScanStats,
    collected: Mutex<Collected>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Collections stay consistent even if another thread panicked mid-scan.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A directory read but not yet encoded: its subdirectories' entries lack
/// their tree digest and size until the level below is encoded.
struct PendingDir {
    abs: Arc<PathBuf>,
    /// Where this directory's entry is: its parent's index in the level
    /// above and the entry's position there (`None` for the root).
    parent: Option<(usize, usize)>,
    entries: Vec<Entry>,
    index_records: Vec<(IndexKey, Vec<Digest>)>,
}

/// A directory to read: where it is, its path in the home, its entry.
type ToRead = (Arc<PathBuf>, PathBuf, Option<(usize, usize)>);

pub(crate) fn scan(
    root: &Path,
    excludes: &Excludes,
    old: &Index,
    rule: KeyRule,
    progress: &dyn Progress,
) -> Result<Scan> {
    let meta = fs::metadata(root).map_err(Error::io(root))?;
    if !meta.is_dir() {
        return Err(Error::Io {
            path: root.to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
        });
    }
    let scanner = Scanner {
        excludes,
        old,
        rule,
        progress,
        stats: ScanStats::default(),
        // Sized as the last scan ended: maps of 100k entries grown from
        // empty are rehashed many times over.
        collected: Mutex::new(Collected {
            trees: HashMap::with_capacity(old.last.as_ref().map_or(0, |last| last.trees.len())),
            index_files: FileMap::with_capacity_and_hasher(old.files.len(), Default::default()),
            aside: None,
        }),
    };
    progress.phase("scanning", None);
    let (root_digest, logical_bytes) = scanner.scan_levels(root)?;
    Ok(Scan {
        root: root_digest,
        logical_bytes,
        collected: scanner
            .collected
            .into_inner()
            .unwrap_or_else(|p| p.into_inner()),
        stats: scanner.stats,
    })
}

impl Scanner<'_> {
    /// Reads the home a level of directories at a time (each level's
    /// directories and files in parallel), then encodes the trees from the
    /// deepest level up. No recursion: a home nested any depth costs
    /// memory, not stack. A home past the bounds a pull checks
    /// ([`crate::tree::check_bounds`]) is refused, since no pull would
    /// take it: nested past [`DEPTH_MAX`], expanding past what
    /// [`Extent::check`] allows (checked as each level is read: a home's
    /// directories are read once each, so what has been read is its
    /// expansion so far), or with trees past
    /// [`crate::tree::DISTINCT_TREE_BYTES_MAX`] (checked once they are
    /// encoded). Returns the root's digest and its file bytes.
    fn scan_levels(&self, root: &Path) -> Result<(Digest, u64)> {
        let mut levels: Vec<Vec<PendingDir>> = Vec::new();
        let mut to_read: Vec<ToRead> = vec![(Arc::new(root.to_owned()), PathBuf::new(), None)];
        let mut seen = Extent::default();
        let what = || format!("directory {}", root.display());
        while !to_read.is_empty() {
            if levels.len() > DEPTH_MAX {
                let (_, rel, _) = &to_read[0];
                return Err(Error::TooDeep {
                    path: rel.clone(),
                    depth_max: DEPTH_MAX,
                });
            }
            let level = to_read
                .par_iter()
                .map(|(abs, rel, parent)| self.read_dir(abs, rel, *parent))
                .collect::<Result<Vec<PendingDir>>>()?;
            let mut next = Vec::new();
            for (index, dir) in level.iter().enumerate() {
                // Its subdirectories' own entries come with their level.
                seen = seen.plus(Extent::of(&dir.entries, &[]));
                for (position, entry) in dir.entries.iter().enumerate() {
                    if let EntryKind::Dir { .. } = entry.kind {
                        let name = std::ffi::OsStr::from_bytes(&entry.name);
                        let rel = to_read[index].1.join(name);
                        next.push((Arc::new(dir.abs.join(name)), rel, Some((index, position))));
                    }
                }
            }
            seen.check(what)?;
            levels.push(level);
            to_read = next;
        }
        let mut root_result = None;
        while let Some(level) = levels.pop() {
            let done = level
                .into_par_iter()
                .map(|dir| {
                    let parent = dir.parent;
                    self.encode_dir(dir)
                        .map(|(digest, total)| (parent, digest, total))
                })
                .collect::<Result<Vec<_>>>()?;
            for (parent, digest, total) in done {
                let Some((index, position)) = parent else {
                    root_result = Some((digest, total));
                    continue;
                };
                // Always there: `parent` was taken from the level above.
                if let Some(entry) = levels
                    .last_mut()
                    .and_then(|above| above.get_mut(index))
                    .and_then(|dir| dir.entries.get_mut(position))
                {
                    entry.kind = EntryKind::Dir { tree: digest };
                    entry.size = total;
                }
            }
        }
        let tree_bytes = lock(&self.collected)
            .trees
            .values()
            .fold(0u64, |sum, node| sum.saturating_add(node.len()));
        crate::tree::check_tree_bytes(tree_bytes, what)?;
        root_result.ok_or_else(|| Error::Io {
            path: root.to_owned(),
            source: std::io::Error::other("scan found no root directory"),
        })
    }

    /// Reads one directory: its files hashed, its subdirectories as
    /// entries to fill in once the level below is encoded.
    fn read_dir(
        &self,
        abs: &Arc<PathBuf>,
        rel: &Path,
        parent: Option<(usize, usize)>,
    ) -> Result<PendingDir> {
        let mut children = Vec::new();
        for entry in fs::read_dir(abs.as_path()).map_err(Error::io(abs.as_path()))? {
            children.push(entry.map_err(Error::io(abs.as_path()))?);
        }
        let scanned = children
            .par_iter()
            .map(|child| self.scan_entry(child, rel))
            .collect::<Result<Vec<Option<(Entry, Option<IndexKey>)>>>>()?;
        let mut entries = Vec::with_capacity(scanned.len());
        let mut index_records = Vec::new();
        for (entry, index_key) in scanned.into_iter().flatten() {
            if let (Some(key), EntryKind::File { blocks }) = (index_key, &entry.kind) {
                index_records.push((key, blocks.clone()));
            }
            entries.push(entry);
        }
        Ok(PendingDir {
            abs: Arc::clone(abs),
            parent,
            entries,
            index_records,
        })
    }

    /// Encodes a directory whose subdirectories are all filled in; returns
    /// its tree digest and the file bytes beneath it.
    fn encode_dir(&self, dir: PendingDir) -> Result<(Digest, u64)> {
        let PendingDir {
            abs,
            entries,
            index_records,
            ..
        } = dir;
        let total = crate::tree::logical_bytes(&entries);
        let mut subtrees = Vec::new();
        let mut blocks = Vec::new();
        for entry in &entries {
            match &entry.kind {
                EntryKind::Dir { tree } => subtrees.push(*tree),
                EntryKind::File { blocks: b } => blocks.extend_from_slice(b),
                EntryKind::Symlink { .. } => {}
            }
        }
        let (digest, bytes) = Tree { entries }.encode().map_err(|e| match e {
            Error::MalformedTree { reason, .. } => Error::Io {
                path: abs.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, reason),
            },
            other => other,
        })?;
        self.stats.dirs.fetch_add(1, Ordering::Relaxed);
        // One lock per directory, not per file.
        let mut collected = lock(&self.collected);
        collected.index_files.extend(index_records);
        collected.trees.entry(digest).or_insert_with(|| TreeNode {
            bytes: TreeBytes::Held(bytes),
            dir: abs,
            subtrees,
            blocks,
        });
        Ok((digest, total))
    }

    /// `mode` as a tree stores it: setuid and setgid cleared, which the
    /// first time in a scan is logged (once: a copied `/usr` can hold many).
    fn stored_mode(&self, child: &fs::DirEntry, mode: u32) -> u32 {
        if mode & SETID_BITS != 0 && self.stats.setid_stripped.fetch_add(1, Ordering::Relaxed) == 0
        {
            tracing::warn!(
                path = %child.path().display(),
                mode = %format!("{mode:o}"),
                "setuid/setgid bits cleared: trees do not carry them (further files not logged)"
            );
        }
        stored_mode(mode)
    }

    /// One directory entry: a file hashed (or found in the index), a
    /// symlink read, a subdirectory noted (its tree is filled in later).
    fn scan_entry(
        &self,
        child: &fs::DirEntry,
        rel: &Path,
    ) -> Result<Option<(Entry, Option<IndexKey>)>> {
        use std::os::unix::ffi::OsStringExt;
        let name = child.file_name();
        if self.excludes.is_excluded(&rel.join(&name)) {
            self.stats.excluded.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        // The entry's path is made only where it is used (a file read, a
        // link read, an error): an unchanged file found in the index
        // needs none, and at 100k files each allocation shows.
        let meta = child.metadata().map_err(|e| Error::io(&child.path())(e))?;
        let file_type = meta.file_type();
        let raw_mode = meta.mode();
        let name = name.into_vec();
        let mut index_key = None;
        let entry = if file_type.is_dir() {
            Entry {
                name,
                mode: self.stored_mode(child, raw_mode),
                size: 0,
                mtime_ns: mtime_ns(&meta),
                // Filled in when the level below is encoded.
                kind: EntryKind::Dir {
                    tree: Digest([0; 32]),
                },
            }
        } else if file_type.is_symlink() {
            let path = child.path();
            let target = fs::read_link(&path).map_err(Error::io(&path))?;
            let target = target.into_os_string().into_vec();
            self.stats.symlinks.fetch_add(1, Ordering::Relaxed);
            Entry {
                name,
                mode: self.stored_mode(child, raw_mode),
                size: target.len() as u64,
                mtime_ns: mtime_ns(&meta),
                kind: EntryKind::Symlink { target },
            }
        } else if file_type.is_file() {
            let (blocks, meta, key) = self.file_blocks(child, meta)?;
            index_key = key;
            self.stats.files.fetch_add(1, Ordering::Relaxed);
            self.stats
                .bytes_scanned
                .fetch_add(meta.size(), Ordering::Relaxed);
            self.progress.advance(meta.size());
            Entry {
                name,
                mode: self.stored_mode(child, meta.mode()),
                size: meta.size(),
                mtime_ns: mtime_ns(&meta),
                kind: EntryKind::File { blocks },
            }
        } else {
            // Sockets, FIFOs and devices are not home content.
            self.stats.special_skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        };
        Ok(Some((entry, index_key)))
    }

    /// The file's block digests, the metadata they belong to, and the key
    /// to record them under in the new index (none while racy).
    fn file_blocks(
        &self,
        child: &fs::DirEntry,
        mut meta: fs::Metadata,
    ) -> Result<(Vec<Digest>, fs::Metadata, Option<IndexKey>)> {
        // Before the index too: no tree can hold such a file, whatever
        // an index says of it.
        let too_large = |meta: &fs::Metadata| {
            (meta.size() > FILE_BYTES_MAX).then(|| Error::FileTooLarge {
                path: child.path(),
                size: meta.size(),
                size_max: FILE_BYTES_MAX,
            })
        };
        if let Some(refused) = too_large(&meta) {
            return Err(refused);
        }
        let key = self.rule.key(&meta);
        if let Some(blocks) = self.old.files.get(&key)
            && blocks.len() as u64 == block_count(key.size)
        {
            return Ok((blocks.clone(), meta, Some(key)));
        }
        let path = &child.path();
        for _ in 0..HASH_ATTEMPTS_MAX {
            // A file grown past the bound since the last attempt's stat.
            if let Some(refused) = too_large(&meta) {
                return Err(refused);
            }
            let before = self.rule.key(&meta);
            let mut file = fs::File::open(path).map_err(Error::io(path))?;
            let blocks = match hash_blocks(&mut file, before.size) {
                Ok(blocks) => blocks,
                Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => {
                    meta = file.metadata().map_err(Error::io(path))?;
                    continue;
                }
                Err(err) => {
                    return Err(Error::Io {
                        path: path.to_owned(),
                        source: err,
                    });
                }
            };
            // Re-check after reading: a write during the read changes ctime.
            let after_meta = file.metadata().map_err(Error::io(path))?;
            let after = self.rule.key(&after_meta);
            if after == before {
                self.stats.files_hashed.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes_hashed
                    .fetch_add(before.size, Ordering::Relaxed);
                let cacheable = !self.rule.is_racy(&after);
                return Ok((blocks, after_meta, cacheable.then_some(after)));
            }
            meta = after_meta;
        }
        Err(Error::FileChanged {
            path: path.to_owned(),
        })
    }
}

thread_local! {
    static READ_BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Reads exactly `size` bytes in block ranges and hashes each block. A
/// file that turns out shorter or longer than `size` is reported as
/// changed by the caller's stat comparison; here it is an error.
fn hash_blocks(file: &mut fs::File, size: u64) -> std::io::Result<Vec<Digest>> {
    let mut blocks = Vec::new();
    for (_, len) in block_ranges(size) {
        // Streamed through blake3's 64 KiB stack buffer: a thread holds
        // that much, never a whole block.
        let mut hasher = blake3::Hasher::new();
        let mut block = file.by_ref().take(len);
        hasher.update_reader(&mut block)?;
        if block.limit() != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "file shrank while reading",
            ));
        }
        blocks.push(Digest(*hasher.finalize().as_bytes()));
    }
    Ok(blocks)
}

/// Reads one block range (`offset`, `len`) of the file at `path` for
/// upload, checks its digest and hands it to `use_block`. The buffer is
/// the thread's own and is reused, so uploading 4 MiB blocks does not
/// churn the allocator.
pub(crate) fn with_block<T>(
    path: &Path,
    offset: u64,
    len: u64,
    digest: &Digest,
    use_block: impl FnOnce(&[u8]) -> Result<T>,
) -> Result<T> {
    use std::io::{Seek, SeekFrom};
    let mut file = fs::File::open(path).map_err(Error::io(path))?;
    file.seek(SeekFrom::Start(offset))
        .map_err(Error::io(path))?;
    READ_BUFFER.with(|buffer| {
        let mut data = buffer.borrow_mut();
        data.clear();
        data.reserve_exact(len as usize);
        file.take(len)
            .read_to_end(&mut data)
            .map_err(Error::io(path))?;
        if Digest::of(&data) != *digest {
            return Err(Error::FileChanged {
                path: path.to_owned(),
            });
        }
        use_block(&data)
    })
}

/// A home of `dirs` directories, each `d{n}/e{n % 4}` holding `files`
/// small files (tests of the scan and of push).
#[cfg(test)]
pub(crate) fn test_home(dirs: usize, files: usize) -> tempfile::TempDir {
    let home = tempfile::tempdir().expect("tempdir");
    for d in 0..dirs {
        let dir = home.path().join(format!("d{d}/e{}", d % 4));
        fs::create_dir_all(&dir).expect("mkdir");
        for f in 0..files {
            fs::write(dir.join(format!("f{f}")), format!("{d}/{f}")).expect("write");
        }
    }
    home
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::NoProgress;

    fn scan_of(dir: &Path, old: &Index, rule: KeyRule) -> Result<Scan> {
        scan(dir, &Excludes::none(), old, rule, &NoProgress)
    }

    /// Regression (audit): a file's whole length was hashed, holes and
    /// all, so a sparse `truncate -s 8E` never finished, and one too large
    /// for any tree failed only once read whole. It is refused before a
    /// byte is read, naming the file and its size. (8 TiB: ext4 allows
    /// no file past 16 TiB.)
    #[test]
    fn regression_a_file_past_the_bound_is_refused_before_it_is_read() {
        let home = tempfile::tempdir().expect("tempdir");
        let size = 1u64 << 43;
        fs::File::create(home.path().join("sparse"))
            .and_then(|file| file.set_len(size))
            .expect("a sparse file");
        let dir = home.path().to_owned();
        let (sender, receiver) = std::sync::mpsc::channel();
        // On its own thread: unfixed, the scan hashes 8 TiB of holes.
        std::thread::spawn(move || {
            let _ = sender.send(scan_of(&dir, &Index::default(), KeyRule::default()).err());
        });
        let refused = receiver
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the scan refuses quickly, reading nothing");
        match refused {
            Some(Error::FileTooLarge {
                path,
                size: found,
                size_max,
            }) => {
                assert_eq!(path, home.path().join("sparse"));
                assert_eq!((found, size_max), (size, FILE_BYTES_MAX));
                let message = Error::FileTooLarge {
                    path,
                    size: found,
                    size_max,
                }
                .to_string();
                assert!(
                    message.contains("sparse") && message.contains(&size.to_string()),
                    "{message}"
                );
            }
            other => panic!("expected FileTooLarge, got {other:?}"),
        }
    }

    /// Regression (audit): the racy rule took the later of mtime and
    /// ctime, so a file whose mtime was set in the future (`touch -d
    /// 2100-01-01`) never went into the index and was hashed on every
    /// save. The second scan hashes nothing.
    #[test]
    fn regression_a_future_mtime_is_not_hashed_on_every_scan() {
        let home = tempfile::tempdir().expect("tempdir");
        let file = fs::File::create(home.path().join("dated")).expect("create");
        std::io::Write::write_all(&mut &file, b"from the future").expect("write");
        let year_2100 = std::time::UNIX_EPOCH + std::time::Duration::from_secs(4_102_444_800);
        file.set_modified(year_2100).expect("set the mtime");
        drop(file);
        // Observed a few seconds on, as a later save would be: the ctime's
        // tick (even a whole-second filesystem's) is over by then.
        let rule = KeyRule {
            dev: None,
            observed_at_ns: Some(crate::index::now_ns() + 3_000_000_000),
        };
        let first = scan_of(home.path(), &Index::default(), rule).expect("first scan");
        assert_eq!(first.stats.files_hashed.load(Ordering::Relaxed), 1);
        let index = Index {
            files: first.collected.index_files,
            last: None,
        };
        let second = scan_of(home.path(), &index, rule).expect("second scan");
        assert_eq!(second.root, first.root);
        assert_eq!(
            second.stats.files_hashed.load(Ordering::Relaxed),
            0,
            "the index holds the file"
        );
    }

    /// Trees set aside read back as they were encoded, and the upload's
    /// walk finds the same blocks in the same places; the aside file is
    /// unnamed, so the directory it lives in stays empty.
    #[test]
    fn trees_set_aside_read_back_as_encoded() {
        let home = test_home(20, 5);
        let mut scan = scan(
            home.path(),
            &Excludes::none(),
            &Index::default(),
            KeyRule::default(),
            &NoProgress,
        )
        .expect("scan");
        let held: HashMap<Digest, Vec<u8>> = scan
            .collected
            .trees
            .iter()
            .map(|(digest, node)| {
                let bytes = scan.collected.tree_bytes(node).expect("held");
                (*digest, bytes.into_owned())
            })
            .collect();
        let mut wanted: Vec<Digest> = scan.collected.all_blocks().into_iter().collect();
        wanted.sort_unstable();
        let places = |collected: &Collected| -> Vec<(Digest, PathBuf)> {
            let sources = collected.block_sources(&scan.root, &wanted).expect("walk");
            let mut decoded = None;
            sources
                .blocks
                .iter()
                .map(|at| (at.digest, sources.path(at, &mut decoded).expect("path")))
                .collect()
        };
        let before = places(&scan.collected);
        assert_eq!(before.len(), 100);

        let aside = tempfile::tempdir().expect("tempdir");
        scan.collected.set_trees_aside(aside.path());
        for (digest, node) in &scan.collected.trees {
            assert!(
                matches!(node.bytes, TreeBytes::Aside { .. }),
                "{digest} is still held"
            );
            let bytes = scan.collected.tree_bytes(node).expect("read back");
            assert_eq!(bytes.as_ref(), held[digest].as_slice());
            assert_eq!(node.len(), held[digest].len() as u64);
        }
        assert_eq!(places(&scan.collected), before);
        let names = fs::read_dir(aside.path()).expect("read dir").count();
        assert_eq!(names, 0, "the aside file has no name");
    }
}
