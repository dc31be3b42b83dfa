//! Pull into an empty directory from objects a round trip away (S3, the
//! block service): the home's blocks read in the order they lie in the
//! store, not directory by directory.
//!
//! Every tree is already in hand ([`super::plan`]). One walk creates every
//! directory (owner-only until the end), writes symlinks and empty files,
//! and lists the files to write. Every block to fetch (each once, however
//! many files hold it) is then sorted by where it lies
//! ([`Objects::locations`]: packs in the order the walk first needs them,
//! then offset) and fetched in windows of at most one pack
//! ([`WINDOW_BYTES`]), so a pack is one ranged read, not one per directory
//! that has files in it nor one per 4 MiB block. A window's read is
//! streamed ([`Objects::get_batch_each`]): its blocks go to a writer
//! thread in parts of about [`PART_BYTES`] as they arrive, the next part
//! arriving while one is written, so memory holds two parts (a 4 MiB
//! block is a part of its own), never a whole pack, whatever the home.
//! A file of one block is written whole as its part arrives. A file of
//! several blocks is written at offsets into its temporary as each of its
//! parts arrives (created at its full size on its first block, so
//! all-zero blocks, never fetched, stay holes; reopened by name and
//! checked to be the same inode for later ones, so no handle is held
//! between parts), and renamed into place after its last block; a failed
//! pull removes the temporaries of files not finished.
//! Directories get their modes and times last, deepest first.
//!
//! Objects that say nothing of where they lie (the block service) are
//! fetched in the walk's order, which follows the push's.
//!
//! Safety is [`super`]'s: names are single validated components created
//! relative to a directory handle, a directory reopened later is opened
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` below the
//! destination, and every block is verified before a byte is written.
//!
//! [`Objects::locations`]: crate::objects::Objects::locations
//! [`Objects::get_batch_each`]: crate::objects::Objects::get_batch_each

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use rayon::prelude::*;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};

use super::Materializer;
use super::write::{disk_mode, io_at, open_child_dir, temp_name, timestamps, zero_block_digest};
use crate::block::block_ranges;
use crate::pack::PackId;
use crate::store::{Location, ObjectId};
use crate::tree::{Entry, EntryKind, Tree};
use crate::{Digest, Error, Result};

/// Stored bytes one window of blocks reads: a whole pack
/// ([`crate::pack::PACK_BYTES_MAX`]), so that a window is one ranged read
/// of one pack where locations are known.
const WINDOW_BYTES: u64 = crate::pack::PACK_BYTES_MAX;
/// Objects in one window: as many as a pack holds.
const WINDOW_OBJECTS: usize = crate::pack::PACK_OBJECTS_MAX;

/// Stored bytes of the blocks handed to the writer at once, as they
/// arrive (or one block, if larger): the writer writes one part while the
/// next arrives.
const PART_BYTES: usize = 2 * 1024 * 1024;
/// Blocks handed to the writer at once, at most.
const PART_OBJECTS: usize = 1024;

/// A directory the walk created: its parent (an index into the walk's
/// directories) and its name there; `None` for the destination itself.
/// Not its path: a hostile tree within the bounds (a chain of 255-byte
/// names hundreds deep above a million directories) would make the paths
/// alone weigh a hundred gigabytes. A path is built where it is used.
struct Dir<'t> {
    parent: Option<(usize, &'t [u8])>,
}

/// The path of directory `at` below the destination ("" for the
/// destination itself).
fn dir_path(dirs: &[Dir<'_>], mut at: usize) -> PathBuf {
    let mut names = Vec::new();
    while let Some((parent, name)) = dirs[at].parent {
        names.push(name);
        at = parent;
    }
    names
        .iter()
        .rev()
        .map(|name| OsStr::from_bytes(name))
        .collect()
}

/// A file to write: its directory (index into the walk's directories) and
/// its entry.
type FileJob<'t> = (usize, &'t Entry);

/// A place a block fills: a file (index into the walk's files), offset,
/// length.
type Part = (usize, u64, u64);

/// What one window writes into one file: the file (index into the walk's
/// files) and its parts there (offset, length, block).
type Writes = (usize, Vec<(u64, u64, Digest)>);

/// A file of several blocks, written as its blocks' windows arrive.
struct Partial {
    /// Its temporary's name in its directory and its inode, once created.
    temp: Option<(OsString, u64)>,
    /// Parts (blocks that are not holes) not written yet.
    left: usize,
    /// Renamed into place.
    done: bool,
}

/// What the windows write into: the destination, the walk's directories
/// and files, and the progress of the files of several blocks (by index
/// into `files`).
struct Writing<'a, 't> {
    dest: &'a OwnedFd,
    dirs: &'a [Dir<'t>],
    files: &'a [FileJob<'t>],
    partial: &'a HashMap<usize, Mutex<Partial>>,
}

impl Materializer<'_> {
    /// Materialises `root` into the empty directory `dest`.
    pub(super) fn materialize_fresh(&self, dest: &OwnedFd, root: &Tree) -> Result<()> {
        self.counters.dirs.fetch_add(1, Ordering::Relaxed);
        let mut dirs: Vec<Dir<'_>> = vec![Dir { parent: None }];
        let mut files: Vec<FileJob<'_>> = Vec::new();
        self.create_dirs(dest, root, &mut dirs, &mut files)?;

        // Each wanted block once, in the order the walk met it, with every
        // place it fills and its length (a window's measure where the
        // store does not say where it lies). Files of several blocks get
        // their progress; their all-zero blocks are holes, never fetched.
        let mut readers: HashMap<Digest, Vec<Part>> = HashMap::new();
        let mut sizes: HashMap<Digest, u64> = HashMap::new();
        let mut blocks: Vec<ObjectId> = Vec::new();
        let mut partial: HashMap<usize, Mutex<Partial>> = HashMap::new();
        for (i, (_, entry)) in files.iter().enumerate() {
            let EntryKind::File { blocks: b } = &entry.kind else {
                continue;
            };
            let split = b.len() > 1;
            let mut left = 0;
            for ((offset, len), digest) in block_ranges(entry.size).zip(b) {
                if split && digest == zero_block_digest() {
                    continue;
                }
                left += 1;
                let users = readers.entry(*digest).or_default();
                if users.is_empty() {
                    blocks.push(ObjectId::block(*digest));
                    sizes.insert(*digest, len);
                }
                users.push((i, offset, len));
            }
            if split {
                partial.insert(
                    i,
                    Mutex::new(Partial {
                        temp: None,
                        left,
                        done: false,
                    }),
                );
            }
        }
        let windows = self.windows(blocks, &sizes)?;
        drop(sizes);

        let writing = Writing {
            dest,
            dirs: &dirs,
            files: &files,
            partial: &partial,
        };
        let written = self.write_windows(&writing, &windows, &readers);
        if written.is_err() {
            // Nothing half-written stays: files of several blocks still
            // under their temporary names go.
            self.remove_partials(&writing);
        }
        written?;

        self.finish_dirs(dest, root)
    }

    /// Gives every directory under `root` its mode and times: last
    /// (writing into a directory changes its mtime, and its mode may
    /// forbid writing), children before their parents. A walk like
    /// [`Materializer::create_dirs`]'s, a handle per level of the current
    /// path, each directory opened by its name in its parent's handle.
    fn finish_dirs(&self, dest: &OwnedFd, root: &Tree) -> Result<()> {
        let dest = dest.try_clone().map_err(crate::Error::io(Path::new("")))?;
        let mut path = PathBuf::new();
        // (handle, tree, next entry to look at, its own entry).
        let mut stack: Vec<(OwnedFd, &Tree, usize, Option<&Entry>)> = vec![(dest, root, 0, None)];
        while let Some(top) = stack.last_mut() {
            let (dir, tree, next) = (&top.0, top.1, &mut top.2);
            let Some(entry) = tree.entries.get(*next) else {
                if let Some((fd, _, _, Some(entry))) = stack.pop() {
                    rustix::fs::fchmod(&fd, disk_mode(entry)).map_err(io_at(&path))?;
                    rustix::fs::futimens(&fd, &timestamps(entry.mtime_ns)).map_err(io_at(&path))?;
                    path.pop();
                }
                continue;
            };
            *next += 1;
            let EntryKind::Dir { tree: digest } = &entry.kind else {
                continue;
            };
            let name = OsStr::from_bytes(&entry.name);
            path.push(name);
            let child = open_child_dir(dir, name).map_err(io_at(&path))?;
            let subtree =
                self.known_trees
                    .get(digest)
                    .ok_or_else(|| crate::Error::MissingObject {
                        digest: *digest,
                        path: Some(path.clone()),
                    })?;
            stack.push((child, subtree, 0, Some(entry)));
        }
        Ok(())
    }

    /// Fetches `windows` in turn, each as one streamed read per pack
    /// ([`Materializer::prefetch_each`]), and writes every place each
    /// block fills: the blocks go to a writer in parts of about
    /// [`PART_BYTES`] as they arrive, handed over only when the writer is
    /// done with the last, so memory holds two parts (one written, one
    /// arriving), not whole windows. Then finishes the files of several
    /// blocks that had nothing to fetch (all holes).
    fn write_windows(
        &self,
        writing: &Writing<'_, '_>,
        windows: &[Vec<ObjectId>],
        readers: &HashMap<Digest, Vec<Part>>,
    ) -> Result<()> {
        let write_part = |(part, fetched): &(Vec<ObjectId>, super::Prefetched)| -> Result<()> {
            // Per file, the places this part fills, by directory.
            let mut per_file: HashMap<usize, Vec<(u64, u64, Digest)>> = HashMap::new();
            for object in part {
                for &(file, offset, len) in readers.get(&object.digest).into_iter().flatten() {
                    per_file
                        .entry(file)
                        .or_default()
                        .push((offset, len, object.digest));
                }
            }
            let mut writes: Vec<Writes> = per_file.into_iter().collect();
            writes.sort_by_key(|(file, _)| (writing.files[*file].0, *file));
            self.write_files(writing, &writes, fetched)
        };
        std::thread::scope(|scope| {
            let (parts, arriving) = std::sync::mpsc::sync_channel(0);
            let writer = scope.spawn(move || -> Result<()> {
                for part in arriving {
                    write_part(&part)?;
                }
                Ok(())
            });
            let fetched = (|| -> Result<()> {
                let mut part: (Vec<ObjectId>, super::Prefetched) = Default::default();
                let mut bytes = 0;
                for window in windows {
                    self.prefetch_each(window.clone(), &mut |object, stored| {
                        part.0.push(object);
                        if let Some(stored) = stored {
                            bytes += stored.len();
                            part.1.insert(object, stored);
                        }
                        if bytes >= PART_BYTES || part.0.len() >= PART_OBJECTS {
                            bytes = 0;
                            parts
                                .send(std::mem::take(&mut part))
                                .map_err(writer_stopped)?;
                        }
                        Ok(())
                    })?;
                }
                if !part.0.is_empty() {
                    parts.send(part).map_err(writer_stopped)?;
                }
                Ok(())
            })();
            drop(parts);
            let written = writer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            // The writer's error first: a part is refused only once the
            // writer has stopped on one.
            written.and(fetched)
        })?;
        let mut rest: Vec<Writes> = writing
            .partial
            .iter()
            .filter(|(_, partial)| !super::lock(partial).done)
            .map(|(file, _)| (*file, Vec::new()))
            .collect();
        rest.sort_by_key(|(file, _)| (writing.files[*file].0, *file));
        self.write_files(writing, &rest, &super::Prefetched::new())
    }

    /// Removes the temporaries of files of several blocks not yet renamed
    /// into place (after a failure; a removal that fails is left).
    fn remove_partials(&self, writing: &Writing<'_, '_>) {
        for (file, partial) in writing.partial {
            let partial = super::lock(partial);
            let Some((temp, _)) = &partial.temp else {
                continue;
            };
            let rel = dir_path(writing.dirs, writing.files[*file].0);
            if let Ok(dir) = open_below(writing.dest, &rel) {
                let _ = rustix::fs::unlinkat(&dir, temp, AtFlags::empty());
            }
        }
    }

    /// Creates every directory under `root` (iteratively: a handle per
    /// level of the current path), writes symlinks and empty files, and
    /// lists the files with content to write.
    fn create_dirs<'t>(
        &'t self,
        dest: &OwnedFd,
        root: &'t Tree,
        dirs: &mut Vec<Dir<'t>>,
        files: &mut Vec<FileJob<'t>>,
    ) -> Result<()> {
        let dest = dest.try_clone().map_err(crate::Error::io(Path::new("")))?;
        // The current directory's path, for errors: one, grown and cut
        // back as the walk goes down and up.
        let mut path = PathBuf::new();
        // (handle, tree, its index in `dirs`, next entry to look at).
        let mut stack: Vec<(OwnedFd, &'t Tree, usize, usize)> = vec![(dest, root, 0, 0)];
        while let Some(top) = stack.last_mut() {
            let (dir, tree, index, next) = (&top.0, top.1, top.2, &mut top.3);
            let Some(entry) = tree.entries.get(*next) else {
                if stack.pop().is_some_and(|(_, _, index, _)| index > 0) {
                    path.pop();
                }
                continue;
            };
            *next += 1;
            let name = OsStr::from_bytes(&entry.name);
            match &entry.kind {
                EntryKind::Dir { tree: digest } => {
                    path.push(name);
                    rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o700))
                        .map_err(io_at(&path))?;
                    let child = open_child_dir(dir, name).map_err(io_at(&path))?;
                    let subtree = self.known_tree(digest, &path)?;
                    self.counters.dirs.fetch_add(1, Ordering::Relaxed);
                    dirs.push(Dir {
                        parent: Some((index, &entry.name)),
                    });
                    stack.push((child, subtree, dirs.len() - 1, 0));
                }
                EntryKind::File { blocks } if !blocks.is_empty() => files.push((index, entry)),
                // Symlinks and empty files: nothing to fetch.
                EntryKind::File { .. } | EntryKind::Symlink { .. } => {
                    self.materialize_entry(
                        dir,
                        entry,
                        None,
                        &path,
                        &super::Prefetched::new(),
                        None,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// A tree fetched ahead (every tree is, before writing begins).
    fn known_tree(&self, digest: &Digest, rel: &Path) -> Result<&Tree> {
        super::lock(&self.trees_seen).push(*digest);
        self.known_trees
            .get(digest)
            .ok_or_else(|| crate::Error::MissingObject {
                digest: *digest,
                path: Some(rel.to_owned()),
            })
    }

    /// `blocks` cut into windows: sorted by where they lie when the store
    /// says, a window never spanning two packs; in the order given when it
    /// does not. `sizes`: each block's file size, a window's measure where
    /// no location says its stored size.
    fn windows(
        &self,
        blocks: Vec<ObjectId>,
        sizes: &HashMap<Digest, u64>,
    ) -> Result<Vec<Vec<ObjectId>>> {
        let locations = self.objects.locations(self.org, &blocks)?;
        // Packs in the order the walk first needs them (roughly the order
        // the push wrote them), so that the packs holding one file's blocks
        // come one after another and the file is finished soon after it
        // is begun.
        let mut rank: HashMap<PackId, usize> = HashMap::new();
        for at in locations.iter().flatten() {
            let next = rank.len();
            rank.entry(at.pack).or_insert(next);
        }
        let mut placed: Vec<(Option<Location>, ObjectId)> =
            locations.into_iter().zip(blocks).collect();
        // Located ones first, by pack and offset; the rest as given (a
        // stable sort).
        placed.sort_by_key(|(at, _)| match at {
            Some(at) => (0, rank[&at.pack], at.offset),
            None => (1, 0, 0),
        });
        let mut windows: Vec<Vec<ObjectId>> = Vec::new();
        let mut current: Vec<ObjectId> = Vec::new();
        let (mut pack, mut bytes) = (None, 0u64);
        for (at, object) in placed {
            let size = match at {
                Some(at) => u64::from(at.length),
                None => sizes.get(&object.digest).copied().unwrap_or(0),
            };
            let here = at.map(|at| at.pack);
            if !current.is_empty()
                && (here != pack || bytes + size > WINDOW_BYTES || current.len() >= WINDOW_OBJECTS)
            {
                windows.push(std::mem::take(&mut current));
                bytes = 0;
            }
            pack = here;
            bytes += size;
            current.push(object);
        }
        if !current.is_empty() {
            windows.push(current);
        }
        Ok(windows)
    }

    /// Writes `writes` (sorted by directory), each directory's files in
    /// parallel with the others', reading blocks from `fetched` first: a
    /// file of one block whole, a file of several the parts this window
    /// holds.
    fn write_files(
        &self,
        writing: &Writing<'_, '_>,
        writes: &[Writes],
        fetched: &super::Prefetched,
    ) -> Result<()> {
        writes
            .chunk_by(|a, b| writing.files[a.0].0 == writing.files[b.0].0)
            .collect::<Vec<_>>()
            .into_par_iter()
            .try_for_each(|group| -> Result<()> {
                let rel = dir_path(writing.dirs, writing.files[group[0].0].0);
                let fd = open_below(writing.dest, &rel)?;
                group.par_iter().try_for_each(|(file, parts)| {
                    let entry = writing.files[*file].1;
                    match writing.partial.get(file) {
                        Some(partial) => {
                            self.write_parts(&fd, &rel, entry, partial, parts, fetched)
                        }
                        None => self.materialize_entry(&fd, entry, None, &rel, fetched, None),
                    }
                })
            })
    }

    /// Writes `parts` (offset, length, block) of a file of several blocks
    /// into its temporary, created on its first parts (at its full size:
    /// holes stay holes) and reopened by name for later ones; renames it
    /// into place once its last part is written. Every block is verified
    /// before a byte of it is written.
    fn write_parts(
        &self,
        dir: &OwnedFd,
        dir_rel: &Path,
        entry: &Entry,
        partial: &Mutex<Partial>,
        parts: &[(u64, u64, Digest)],
        fetched: &super::Prefetched,
    ) -> Result<()> {
        let name = OsStr::from_bytes(&entry.name);
        let rel = dir_rel.join(name);
        let mut partial = super::lock(partial);
        let file = match &partial.temp {
            None => {
                let temp = temp_name(&entry.name);
                let fd = rustix::fs::openat(
                    dir,
                    &temp,
                    OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::WRONLY
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(io_at(&rel))?;
                let stat = rustix::fs::fstat(&fd).map_err(io_at(&rel))?;
                partial.temp = Some((temp, stat.st_ino));
                let file = File::from(fd);
                file.set_len(entry.size).map_err(Error::io(&rel))?;
                file
            }
            Some((temp, ino)) => {
                let fd = rustix::fs::openat(
                    dir,
                    temp,
                    OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(io_at(&rel))?;
                // Still the file this pull created, and only here.
                let stat = rustix::fs::fstat(&fd).map_err(io_at(&rel))?;
                if stat.st_ino != *ino
                    || stat.st_nlink != 1
                    || FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile
                {
                    return Err(Error::Io {
                        path: rel,
                        source: std::io::Error::other("temporary file replaced during the pull"),
                    });
                }
                File::from(fd)
            }
        };
        for (offset, len, digest) in parts {
            self.with_block(digest, *len, &rel, fetched, |data| {
                file.write_all_at(data, *offset).map_err(Error::io(&rel))
            })?;
            self.progress.advance(*len);
        }
        partial.left = partial.left.saturating_sub(parts.len());
        if partial.left > 0 {
            return Ok(());
        }
        // The last part: holes count as written, then mode, times, name.
        let EntryKind::File { blocks } = &entry.kind else {
            return Ok(());
        };
        let holes = block_ranges(entry.size)
            .zip(blocks)
            .filter(|(_, digest)| *digest == zero_block_digest())
            .map(|((_, len), _)| len)
            .sum();
        self.progress.advance(holes);
        rustix::fs::fchmod(&file, disk_mode(entry)).map_err(io_at(&rel))?;
        rustix::fs::futimens(&file, &timestamps(entry.mtime_ns)).map_err(io_at(&rel))?;
        let Some((temp, _)) = partial.temp.take() else {
            return Ok(());
        };
        if let Err(errno) = rustix::fs::renameat(dir, &temp, dir, name) {
            let _ = rustix::fs::unlinkat(dir, &temp, AtFlags::empty());
            return Err(io_at(&rel)(errno));
        }
        partial.done = true;
        // The handle still names the file after the rename; its ctime now
        // includes the rename.
        let stat = rustix::fs::fstat(&file).map_err(io_at(&rel))?;
        self.record_index(&stat, entry);
        self.counters.files.fetch_add(1, Ordering::Relaxed);
        self.counters.files_written.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Opens the directory `rel` below `dest` (the destination itself for
/// ""), refusing any symlink on the way and any path leaving `dest`.
fn open_below(dest: &OwnedFd, rel: &Path) -> Result<OwnedFd> {
    let rel_or_dot = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    rustix::fs::openat2(
        dest,
        rel_or_dot,
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(io_at(rel))
}

/// The fetch's error when the writer stopped (on an error of its own,
/// which is the one reported).
fn writer_stopped<T>(_: std::sync::mpsc::SendError<T>) -> Error {
    Error::Io {
        path: PathBuf::new(),
        source: std::io::Error::other("the pull's writer stopped"),
    }
}
