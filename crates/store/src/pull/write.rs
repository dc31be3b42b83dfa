//! Pull's writing: making a destination directory match a tree, in
//! place, through directory handles (see the safety rules in
//! [`super`]): what is there is compared, what differs replaced, what the
//! tree lacks removed, and every file written recorded in the new index.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use rayon::prelude::*;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, Timespec, Timestamps};

use super::{Materializer, Prefetched, lock};
use crate::block::{SPLIT_BLOCK_BYTES, block_ranges};
use crate::index::{IndexKey, timestamp_ns};
use crate::tree::{Entry, EntryKind, Tree, stored_mode};
use crate::{Digest, Error, Result};

const TEMP_PREFIX: &str = ".roost-tmp-";

pub(super) fn zero_block_digest() -> &'static Digest {
    static ZERO: OnceLock<Digest> = OnceLock::new();
    ZERO.get_or_init(|| Digest::of(&vec![0u8; SPLIT_BLOCK_BYTES as usize]))
}

pub(super) fn io_at(path: &Path) -> impl FnOnce(rustix::io::Errno) -> Error + '_ {
    move |errno| Error::Io {
        path: path.to_owned(),
        source: errno.into(),
    }
}

/// Opens the directory `name` in `dir` as a handle to write below,
/// refusing a symlink (or anything not a directory) put in its place.
pub(super) fn open_child_dir(dir: impl AsFd, name: &OsStr) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
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

pub(super) fn timestamps(mtime_ns: i64) -> Timestamps {
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
    /// `created` says we made `dir` in this pull, so it holds nothing of
    /// its own yet (an existing directory is listed and compared instead).
    /// `inherited` holds the small files' blocks of this whole subtree,
    /// fetched by an ancestor (only for a directory this pull created).
    pub(super) fn materialize_dir(
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
        if !self.objects.reads_in_batches() {
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

    /// The stat of a file already holding exactly `blocks` (by the old
    /// index), which then needs at most its mode and mtime touched up.
    pub(super) fn unchanged<'s>(
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
    pub(super) fn materialize_entry(
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
                let child = open_child_dir(dir, name).map_err(io_at(&rel))?;
                if !created {
                    ensure_writable_dir(&child).map_err(io_at(&rel))?;
                }
                let subtree = self.fetch_tree(tree, &rel, prefetched)?;
                let inherited = inherited.filter(|_| created);
                self.materialize_dir(&child, &subtree, &rel, created, inherited)?;
                rustix::fs::fchmod(&child, disk_mode(entry)).map_err(io_at(&rel))?;
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
        if stat.st_mode & 0o7777 != stored_mode(entry.mode)
            || self.index_key(stat).mtime_ns != entry.mtime_ns
        {
            let fd = rustix::fs::openat(
                dir,
                name,
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(io_at(rel))?;
            rustix::fs::fchmod(&fd, disk_mode(entry)).map_err(io_at(rel))?;
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
                    self.with_block(digest, len, rel, prefetched, |data| {
                        file.write_all(data).map_err(Error::io(rel))
                    })?;
                }
                self.progress.advance(len);
            }
            if ends_in_hole {
                file.set_len(entry.size).map_err(Error::io(rel))?;
            }
            rustix::fs::fchmod(file.as_fd(), disk_mode(entry)).map_err(io_at(rel))?;
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
    pub(super) fn record_index(&self, stat: &rustix::fs::Stat, entry: &Entry) {
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

pub(super) fn temp_name(name: &[u8]) -> std::ffi::OsString {
    use std::sync::atomic::AtomicU64;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tag = &Digest::of(name).to_hex()[..8];
    std::ffi::OsString::from(format!("{TEMP_PREFIX}{}-{n}-{tag}", std::process::id()))
}

/// Whether the directory holds no entry at all.
pub(super) fn is_empty_dir(dir: &OwnedFd) -> rustix::io::Result<bool> {
    let mut iter = rustix::fs::Dir::read_from(dir)?;
    while let Some(entry) = iter.read() {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            return Ok(false);
        }
    }
    Ok(true)
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

/// The mode pull gives what `entry` names: never setuid or setgid, even
/// from a tree stored before the store refused them (see [`crate::tree`]),
/// whoever pulls (a root pull would otherwise make root-owned setuid
/// programs of tenant content).
pub(super) fn disk_mode(entry: &Entry) -> Mode {
    Mode::from_raw_mode(stored_mode(entry.mode))
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
/// Iterative: what is removed is whatever the destination held (a sandbox
/// may have nested directories thousands deep), so depth costs a handle
/// per level (too many ends in an error, not a crash), never stack.
fn remove_entry(dir: &OwnedFd, name: &[u8]) -> rustix::io::Result<()> {
    let Some(first) = open_for_removal(dir, name)? else {
        return Ok(());
    };
    // Each directory being emptied: its handle, the names left in it, and
    // its own name in the directory above.
    let mut stack: Vec<(OwnedFd, Vec<Vec<u8>>, Vec<u8>)> = Vec::new();
    let names = list_names(&first)?;
    stack.push((first, names, name.to_vec()));
    while let Some((current, mut names, own_name)) = stack.pop() {
        if let Some(child) = names.pop() {
            let opened = open_for_removal(&current, &child)?;
            stack.push((current, names, own_name));
            if let Some(child_dir) = opened {
                let grandchildren = list_names(&child_dir)?;
                stack.push((child_dir, grandchildren, child));
            }
            continue;
        }
        drop(current);
        let parent = stack.last().map_or(dir, |(fd, _, _)| fd);
        rustix::fs::unlinkat(parent, OsStr::from_bytes(&own_name), AtFlags::REMOVEDIR)?;
    }
    Ok(())
}

/// Unlinks `name` in `dir` if it is not a directory (`None`), or opens the
/// directory it is, writable, to be emptied (`Some`). Gone already: `None`.
fn open_for_removal(dir: &OwnedFd, name: &[u8]) -> rustix::io::Result<Option<OwnedFd>> {
    let name = OsStr::from_bytes(name);
    let stat = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => stat,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(errno) => return Err(errno),
    };
    if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
        rustix::fs::unlinkat(dir, name, AtFlags::empty())?;
        return Ok(None);
    }
    let child = open_child_dir(dir, name)?;
    ensure_writable_dir(&child)?;
    Ok(Some(child))
}
