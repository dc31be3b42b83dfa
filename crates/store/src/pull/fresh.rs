//! Pull into an empty directory from objects a round trip away (S3, the
//! block service): the home's blocks read in the order they lie in the
//! store, not directory by directory.
//!
//! Every tree is already in hand ([`super::plan`]). One walk creates every
//! directory (owner-only until the end), writes symlinks and empty files,
//! and lists the files to write. The blocks of single-block files are then
//! sorted by where they lie ([`Objects::locations`]: pack, then offset)
//! and fetched in windows of at most one pack ([`WINDOW_BYTES`]), so a
//! pack is one ranged read, not one per directory that has files in it;
//! each file is written as soon as its window arrives (the next window is
//! fetched while one is written), so memory holds two windows whatever
//! the home. Files of several blocks come block by block, like any large
//! object. Directories get their modes and times last, deepest first.
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

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use rayon::prelude::*;
use rustix::fs::{Mode, OFlags, ResolveFlags};

use super::Materializer;
use super::write::{disk_mode, io_at, timestamps};
use crate::store::{Location, ObjectId};
use crate::tree::{Entry, EntryKind, Tree};
use crate::{Digest, Result};

/// Stored bytes one window of blocks reads: a whole pack
/// ([`crate::pack::PACK_BYTES_MAX`]), so that a window is one ranged read
/// of one pack where locations are known.
const WINDOW_BYTES: u64 = crate::pack::PACK_BYTES_MAX;
/// Objects in one window: as many as a pack holds.
const WINDOW_OBJECTS: usize = crate::pack::PACK_OBJECTS_MAX;

/// A directory the walk created.
struct Dir<'t> {
    /// Its path below the destination ("" for the destination itself).
    rel: PathBuf,
    /// Its entry in its parent (`None`: the destination).
    entry: Option<&'t Entry>,
}

/// A file to write: its directory (index into the walk's directories) and
/// its entry.
type FileJob<'t> = (usize, &'t Entry);

impl Materializer<'_> {
    /// Materialises `root` into the empty directory `dest`.
    pub(super) fn materialize_fresh(&self, dest: &OwnedFd, root: &Tree) -> Result<()> {
        self.counters.dirs.fetch_add(1, Ordering::Relaxed);
        let mut dirs: Vec<Dir<'_>> = vec![Dir {
            rel: PathBuf::new(),
            entry: None,
        }];
        // Files of one block (most), and of several.
        let mut single: Vec<FileJob<'_>> = Vec::new();
        let mut split: Vec<FileJob<'_>> = Vec::new();
        self.create_dirs(dest, root, &mut dirs, &mut single, &mut split)?;

        // Each wanted block once, in the order the walk met it, with the
        // files it fills and its size (a window's measure where the store
        // does not say where it lies).
        let mut readers: HashMap<Digest, Vec<usize>> = HashMap::new();
        let mut sizes: HashMap<Digest, u64> = HashMap::new();
        let mut blocks: Vec<ObjectId> = Vec::new();
        for (i, (_, entry)) in single.iter().enumerate() {
            let EntryKind::File { blocks: b } = &entry.kind else {
                continue;
            };
            let users = readers.entry(b[0]).or_default();
            if users.is_empty() {
                blocks.push(ObjectId::block(b[0]));
                sizes.insert(b[0], entry.size);
            }
            users.push(i);
        }
        let windows = self.windows(blocks, &sizes)?;
        drop(sizes);

        // Fetch window i + 1 while window i is written.
        let write_window = |window: &[ObjectId], fetched: &super::Prefetched| -> Result<()> {
            let mut jobs: Vec<&FileJob<'_>> = window
                .iter()
                .flat_map(|object| readers.get(&object.digest).into_iter().flatten())
                .map(|&i| &single[i])
                .collect();
            jobs.sort_by_key(|(dir, _)| *dir);
            self.write_files(dest, &dirs, &jobs, fetched)
        };
        let mut fetched = match windows.first() {
            Some(first) => self.prefetch(first.clone(), Path::new(""))?,
            None => super::Prefetched::new(),
        };
        for (i, window) in windows.iter().enumerate() {
            let (written, next) = rayon::join(
                || write_window(window, &fetched),
                || match windows.get(i + 1) {
                    Some(next) => self.prefetch(next.clone(), Path::new("")),
                    None => Ok(super::Prefetched::new()),
                },
            );
            written?;
            fetched = next?;
        }
        drop(fetched);

        // Files of several blocks: a block per read, like any large object.
        split.sort_by_key(|(dir, _)| *dir);
        let jobs: Vec<&FileJob<'_>> = split.iter().collect();
        self.write_files(dest, &dirs, &jobs, &super::Prefetched::new())?;

        // Modes and times last (writing into a directory changes its
        // mtime, and its mode may forbid writing), children before their
        // parents: the walk created parents first.
        for dir in dirs.iter().skip(1).rev() {
            let Some(entry) = dir.entry else { continue };
            let fd = open_below(dest, &dir.rel)?;
            rustix::fs::fchmod(&fd, disk_mode(entry)).map_err(io_at(&dir.rel))?;
            rustix::fs::futimens(&fd, &timestamps(entry.mtime_ns)).map_err(io_at(&dir.rel))?;
        }
        Ok(())
    }

    /// Creates every directory under `root` (iteratively: a handle per
    /// level of the current path), writes symlinks and empty files, and
    /// lists the files to write.
    fn create_dirs<'t>(
        &'t self,
        dest: &OwnedFd,
        root: &'t Tree,
        dirs: &mut Vec<Dir<'t>>,
        single: &mut Vec<FileJob<'t>>,
        split: &mut Vec<FileJob<'t>>,
    ) -> Result<()> {
        let dest = dest.try_clone().map_err(crate::Error::io(Path::new("")))?;
        // (handle, tree, its index in `dirs`, next entry to look at).
        let mut stack: Vec<(OwnedFd, &'t Tree, usize, usize)> = vec![(dest, root, 0, 0)];
        while let Some(top) = stack.last_mut() {
            let (dir, tree, index, next) = (&top.0, top.1, top.2, &mut top.3);
            let Some(entry) = tree.entries.get(*next) else {
                stack.pop();
                continue;
            };
            *next += 1;
            let name = OsStr::from_bytes(&entry.name);
            match &entry.kind {
                EntryKind::Dir { tree: digest } => {
                    let rel = dirs[index].rel.join(name);
                    rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o700))
                        .map_err(io_at(&rel))?;
                    let child = rustix::fs::openat(
                        dir,
                        name,
                        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                        Mode::empty(),
                    )
                    .map_err(io_at(&rel))?;
                    let subtree = self.known_tree(digest, &rel)?;
                    self.counters.dirs.fetch_add(1, Ordering::Relaxed);
                    dirs.push(Dir {
                        rel,
                        entry: Some(entry),
                    });
                    stack.push((child, subtree, dirs.len() - 1, 0));
                }
                EntryKind::File { blocks } if blocks.len() == 1 => single.push((index, entry)),
                EntryKind::File { blocks } if blocks.len() > 1 => split.push((index, entry)),
                // Symlinks and empty files: nothing to fetch.
                EntryKind::File { .. } | EntryKind::Symlink { .. } => {
                    let rel = dirs[index].rel.clone();
                    self.materialize_entry(
                        dir,
                        entry,
                        None,
                        &rel,
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
        let mut placed: Vec<(Option<Location>, ObjectId)> =
            locations.into_iter().zip(blocks).collect();
        // Located ones first, by pack and offset; the rest as given.
        placed.sort_by_key(|(at, _)| match at {
            Some(at) => (0, Some((at.pack, at.offset))),
            None => (1, None),
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

    /// Writes `jobs` (sorted by directory), each directory's in parallel
    /// with the others', reading blocks from `fetched` first.
    fn write_files(
        &self,
        dest: &OwnedFd,
        dirs: &[Dir<'_>],
        jobs: &[&FileJob<'_>],
        fetched: &super::Prefetched,
    ) -> Result<()> {
        jobs.chunk_by(|a, b| a.0 == b.0)
            .collect::<Vec<_>>()
            .into_par_iter()
            .try_for_each(|group| -> Result<()> {
                let dir = &dirs[group[0].0];
                let fd = open_below(dest, &dir.rel)?;
                group.par_iter().try_for_each(|(_, entry)| {
                    self.materialize_entry(&fd, entry, None, &dir.rel, fetched, None)
                })
            })
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
