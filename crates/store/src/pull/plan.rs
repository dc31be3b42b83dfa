//! Pull's planning: which trees and blocks to fetch, in what batches.
//! Every tree comes first, a level per batch (from any store: pull checks
//! the whole tree's bounds before writing); then, from objects that read
//! in batches ([`Objects::reads_in_batches`]), small files' blocks
//! come a window at a time: a directory's own files, or whole subtrees the
//! pull creates, several to a window, before they are written.
//!
//! [`Objects::reads_in_batches`]: crate::objects::Objects::reads_in_batches

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::FileType;

use super::Materializer;
use crate::store::ObjectId;
use crate::tree::{DEPTH_MAX, EXPANDED_ENTRIES_MAX, Entry, EntryKind, Tree};
use crate::{Digest, Error, Result};

/// Files up to this size have their blocks fetched with their directory's
/// window when the store reads in batches; larger ones block by block.
pub(super) const PREFETCH_FILE_BYTES_MAX: u64 = 1024 * 1024;
/// A window of files holds at most this many objects...
const PREFETCH_WINDOW_OBJECTS: usize = 1024;
/// ...and this many bytes of content: what one window holds in memory.
const PREFETCH_WINDOW_BYTES: u64 = 16 * 1024 * 1024;
/// Entries looked at to size a subtree before it counts as too large for
/// a window (trees may share subtrees; this bounds the walk).
const PREFETCH_SUBTREE_ENTRIES_MAX: usize = 4 * PREFETCH_WINDOW_OBJECTS;

impl Materializer<'_> {
    /// Fetches every tree under `root` into `known_trees`, a level at a
    /// time, each level in as few requests as the batch size allows. Stops
    /// at a level past [`DEPTH_MAX`] (every tree first met there is nested
    /// at least that deep) and once the distinct trees alone pass
    /// [`EXPANDED_ENTRIES_MAX`], so a hostile chain of trees is not
    /// fetched to its end; [`crate::tree::check_bounds`] measures the rest.
    pub(super) fn load_trees(&mut self, root_digest: &Digest, root: &Tree) -> Result<()> {
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
        let mut depth = 1;
        while !level.is_empty() {
            level.sort_unstable_by_key(|(digest, _)| *digest);
            level.dedup_by_key(|(digest, _)| *digest);
            level.retain(|(digest, _)| !self.known_trees.contains_key(digest));
            if let Some((_, rel)) = level.first()
                && depth > DEPTH_MAX
            {
                return Err(Error::TooDeep {
                    path: rel.clone(),
                    depth_max: DEPTH_MAX,
                });
            }
            if self.known_trees.len() as u64 > EXPANDED_ENTRIES_MAX {
                return Err(Error::TooManyEntries {
                    what: format!("tree {root_digest}"),
                    entries_max: EXPANDED_ENTRIES_MAX,
                });
            }
            depth += 1;
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

    /// Splits a directory's subdirectories into runs: those this pull
    /// creates whose subtrees' small-file blocks fit a window together
    /// (`true`, with those blocks), and one at a time the rest (`false`).
    pub(super) fn subtree_groups(
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
    pub(super) fn file_windows(
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
}
