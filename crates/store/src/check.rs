//! Whether trees are complete in a store: every tree reachable from a
//! root read and verified (its digest, then its encoding), every block it
//! names present, or with `deep` read and verified too.
//!
//! What a restored deployment's check ([`roots`]) and a copy's pointer
//! step ([`crate::copy`]) ask. It does not rely on "a present tree has its
//! whole subtree" (a store being copied into does not keep it until the
//! copy ends): it walks everything, a level of trees at a time across all
//! the roots of an org, each distinct object once, with the org's pack
//! index answering presence in memory. No recursion: the fold that sums
//! what is missing below each tree is [`crate::tree::fold_bottom_up`].

use std::collections::{HashMap, HashSet};

use rayon::prelude::*;

use crate::store::ObjectId;
use crate::tree::{EntryKind, Tree};
use crate::{Digest, Error, Objects, OrgId, Result, Store};

/// What is wrong below one root (nothing, for a complete tree).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RootStatus {
    /// Objects reachable from the root that are absent (a subtree shared
    /// by two directories counts for each).
    pub missing: u64,
    /// Objects present that do not decode to their name.
    pub corrupt: u64,
    /// One of them, to name in a report.
    pub first_fault: Option<ObjectId>,
}

impl RootStatus {
    pub fn complete(&self) -> bool {
        self.missing == 0 && self.corrupt == 0
    }

    fn add(&mut self, other: &RootStatus) {
        self.missing = self.missing.saturating_add(other.missing);
        self.corrupt = self.corrupt.saturating_add(other.corrupt);
        if self.first_fault.is_none() {
            self.first_fault = other.first_fault;
        }
    }
}

/// Totals of a check, for reports and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checked {
    pub trees: u64,
    pub blocks: u64,
}

/// Trees read per batch: one ranged read per pack neighbourhood on S3.
const TREE_BATCH: usize = 1024;
/// Blocks read per batch with `deep`: bounded memory (blocks are ≤ 8 MiB).
const DEEP_BATCH: usize = 64;

/// Checks each of `org`'s `roots` in `store`: which are complete. Backend
/// errors are errors (never "missing"); faults in the data are answers.
pub fn roots(
    store: &Store,
    org: &OrgId,
    roots: &[Digest],
    deep: bool,
) -> Result<(HashMap<Digest, RootStatus>, Checked)> {
    // Each tree's subtrees, and its own faults (itself or its blocks).
    let mut children: HashMap<Digest, Vec<Digest>> = HashMap::new();
    let mut own: HashMap<Digest, RootStatus> = HashMap::new();
    let mut seen: HashSet<Digest> = roots.iter().copied().collect();
    let mut frontier: Vec<Digest> = seen.iter().copied().collect();
    let mut checked = Checked::default();
    while !frontier.is_empty() {
        let mut next = Vec::new();
        for batch in frontier.chunks(TREE_BATCH) {
            let ids: Vec<ObjectId> = batch.iter().map(|d| ObjectId::tree(*d)).collect();
            let read = store.get_batch(org, &ids)?;
            let decoded: Vec<(Digest, std::result::Result<Option<Tree>, ()>)> = batch
                .par_iter()
                .zip(read)
                .map(|(digest, bytes)| {
                    let Some(bytes) = bytes else {
                        return Ok((*digest, Ok(None)));
                    };
                    match crate::block::decode(digest, &bytes)
                        .and_then(|plain| Tree::decode(digest, &plain))
                    {
                        Ok(tree) => Ok((*digest, Ok(Some(tree)))),
                        Err(Error::Corrupt { .. } | Error::MalformedTree { .. }) => {
                            Ok((*digest, Err(())))
                        }
                        Err(err) => Err(err),
                    }
                })
                .collect::<Result<_>>()?;
            let mut blocks: Vec<ObjectId> = Vec::new();
            let mut blocks_of: Vec<(Digest, Vec<ObjectId>)> = Vec::new();
            for (digest, outcome) in decoded {
                checked.trees += 1;
                let status = own.entry(digest).or_default();
                match outcome {
                    Ok(None) => {
                        status.missing += 1;
                        status.first_fault = Some(ObjectId::tree(digest));
                    }
                    Err(()) => {
                        status.corrupt += 1;
                        status.first_fault = Some(ObjectId::tree(digest));
                    }
                    Ok(Some(tree)) => {
                        let mut subtrees = Vec::new();
                        let mut mine = Vec::new();
                        for entry in tree.entries {
                            match entry.kind {
                                EntryKind::Dir { tree } => {
                                    subtrees.push(tree);
                                    if seen.insert(tree) {
                                        next.push(tree);
                                    }
                                }
                                EntryKind::File { blocks: b } => {
                                    mine.extend(b.into_iter().map(ObjectId::block));
                                }
                                EntryKind::Symlink { .. } => {}
                            }
                        }
                        mine.sort_unstable();
                        mine.dedup();
                        blocks.extend(&mine);
                        blocks_of.push((digest, mine));
                        children.insert(digest, subtrees);
                    }
                }
            }
            blocks.sort_unstable();
            blocks.dedup();
            checked.blocks += blocks.len() as u64;
            let absent: HashSet<ObjectId> = store.missing(org, &blocks)?.into_iter().collect();
            let corrupt: HashSet<ObjectId> = if deep {
                let present: Vec<ObjectId> = blocks
                    .iter()
                    .filter(|b| !absent.contains(b))
                    .copied()
                    .collect();
                corrupt_blocks(store, org, &present)?
            } else {
                HashSet::new()
            };
            // A block shared by two trees counts for each (as it would in
            // the home); within one tree once.
            for (tree, mine) in blocks_of {
                let status = own.entry(tree).or_default();
                for block in mine {
                    let fault = if absent.contains(&block) {
                        status.missing += 1;
                        true
                    } else if corrupt.contains(&block) {
                        status.corrupt += 1;
                        true
                    } else {
                        false
                    };
                    if fault && status.first_fault.is_none() {
                        status.first_fault = Some(block);
                    }
                }
            }
        }
        frontier = next;
    }
    let folded = crate::tree::fold_bottom_up(
        roots.iter().copied(),
        |tree: &Digest| children.get(tree).cloned().unwrap_or_default(),
        |tree, below: &[RootStatus]| {
            let mut status = own.get(tree).cloned().unwrap_or_default();
            for child in below {
                status.add(child);
            }
            status
        },
    );
    let statuses = roots
        .iter()
        .map(|root| (*root, folded.get(root).cloned().unwrap_or_default()))
        .collect();
    Ok((statuses, checked))
}

/// Which of `blocks` (present) do not decode to their name.
fn corrupt_blocks(store: &Store, org: &OrgId, blocks: &[ObjectId]) -> Result<HashSet<ObjectId>> {
    let mut corrupt = HashSet::new();
    for batch in blocks.chunks(DEEP_BATCH) {
        let read = store.get_batch(org, batch)?;
        let bad: Vec<ObjectId> = batch
            .par_iter()
            .zip(read)
            .filter_map(|(object, bytes)| match bytes {
                Some(bytes) => crate::block::decode(&object.digest, &bytes)
                    .is_err()
                    .then_some(*object),
                // Gone since the existence answer: as bad as corrupt here.
                None => Some(*object),
            })
            .collect();
        corrupt.extend(bad);
    }
    Ok(corrupt)
}
