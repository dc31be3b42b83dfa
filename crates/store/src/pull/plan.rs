//! Pull's planning: which trees and blocks to fetch, in what batches.
//! Every tree comes first, a level per batch (from any store: pull checks
//! the whole tree's bounds before writing); then, from objects that read
//! in batches ([`Objects::reads_in_batches`]), small files' blocks
//! come a window at a time: a directory's own files, or whole subtrees the
//! pull creates, several to a window, before they are written.
//!
//! [`Objects::reads_in_batches`]: crate::objects::Objects::reads_in_batches

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::FileType;

use super::{Materializer, Prefetched};
use crate::store::ObjectId;
use crate::tree::{
    DEPTH_MAX, EXPANDED_ENTRIES_MAX, Entry, EntryKind, Tree, check_tree_bytes, encoded_len,
};
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

/// Where a tree was first met, for the paths errors name: the tree, and
/// its entry in the tree of the place before (`None`: the root). A path
/// is built only for an error, never kept per tree: a hostile tree's
/// paths (255-byte names, hundreds deep) would cost far more than its
/// trees.
struct Place {
    tree: Digest,
    parent: Option<(usize, usize)>,
}

impl Materializer<'_> {
    /// Fetches every tree under `root` (already in `known_trees`) into
    /// `known_trees`, a level at a time, each level in as few requests as
    /// the batch size allows and decoded as it arrives. Stops at a level
    /// past [`DEPTH_MAX`] (every tree first met there is nested at least
    /// that deep), and as soon as the distinct trees alone pass
    /// [`EXPANDED_ENTRIES_MAX`] entries or
    /// [`crate::tree::DISTINCT_TREE_BYTES_MAX`]
    /// bytes (each distinct tree is at least once in the expansion, so the
    /// expansion would pass them too): what a hostile store makes a pull
    /// hold is bounded before it is held. [`crate::tree::check_bounds`]
    /// measures the rest.
    pub(super) fn load_trees(&mut self, root_digest: &Digest) -> Result<()> {
        let too_many_entries = || Error::TooManyEntries {
            what: format!("tree {root_digest}"),
            entries_max: EXPANDED_ENTRIES_MAX,
        };
        let (mut entries, mut bytes) = match self.known_trees.get(root_digest) {
            Some(root) => (root.entries.len() as u64, encoded_len(root)),
            None => (0, 0),
        };
        let mut places = vec![Place {
            tree: *root_digest,
            parent: None,
        }];
        let mut level = self.new_subtrees(&mut places, &[0]);
        let mut depth = 1;
        while !level.is_empty() {
            if depth > DEPTH_MAX {
                return Err(Error::TooDeep {
                    path: self.place_path(&places, level[0]),
                    depth_max: DEPTH_MAX,
                });
            }
            depth += 1;
            let at: HashMap<Digest, usize> = level.iter().map(|&p| (places[p].tree, p)).collect();
            let objects = level
                .iter()
                .map(|&p| ObjectId::tree(places[p].tree))
                .collect();
            let mut fetched: HashMap<Digest, Tree> = HashMap::with_capacity(level.len());
            self.prefetch_each(objects, &mut |object, stored| {
                let place = at.get(&object.digest).copied().unwrap_or(0);
                let mut one = Prefetched::new();
                if let Some(stored) = stored {
                    one.insert(object, stored);
                }
                // Absent from the batch: read on its own (the block cache,
                // or the store, whose error names it).
                let tree = self
                    .fetch(&object, Path::new(""), &one)
                    .and_then(|plain| {
                        bytes = bytes.saturating_add(plain.len() as u64);
                        check_tree_bytes(bytes, || format!("tree {root_digest}"))?;
                        Tree::decode(&object.digest, &plain)
                    })
                    .map_err(|e| e.at(&self.place_path(&places, place)))?;
                entries = entries.saturating_add(tree.entries.len() as u64);
                if entries > EXPANDED_ENTRIES_MAX {
                    return Err(too_many_entries());
                }
                fetched.insert(object.digest, tree);
                Ok(())
            })?;
            self.known_trees.extend(fetched);
            level = self.new_subtrees(&mut places, &level);
        }
        Ok(())
    }

    /// The trees the trees at `parents` name that are not known yet, each
    /// once, in the order met, as new places.
    fn new_subtrees(&self, places: &mut Vec<Place>, parents: &[usize]) -> Vec<usize> {
        let mut met: HashSet<Digest> = HashSet::new();
        let mut new = Vec::new();
        for &parent in parents {
            let Some(tree) = self.known_trees.get(&places[parent].tree) else {
                continue;
            };
            for (index, entry) in tree.entries.iter().enumerate() {
                if let EntryKind::Dir { tree } = &entry.kind
                    && !self.known_trees.contains_key(tree)
                    && met.insert(*tree)
                {
                    places.push(Place {
                        tree: *tree,
                        parent: Some((parent, index)),
                    });
                    new.push(places.len() - 1);
                }
            }
        }
        new
    }

    /// The path of the place `at` below the root.
    fn place_path(&self, places: &[Place], mut at: usize) -> PathBuf {
        let mut names = Vec::new();
        while let Some((parent, index)) = places[at].parent {
            let name = self
                .known_trees
                .get(&places[parent].tree)
                .and_then(|tree| tree.entries.get(index))
                .map(|entry| entry.name.as_slice());
            names.extend(name);
            at = parent;
        }
        names
            .iter()
            .rev()
            .map(|name| OsStr::from_bytes(name))
            .collect()
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
