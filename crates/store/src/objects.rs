//! One org's objects by name (kind and digest): the level push's upload
//! and pull's materialise work at, so they run unchanged against a store
//! they hold ([`crate::Store`], over any backend) or against the control
//! plane's block service (`api::blocks::RemoteBackend`).
//!
//! Keys, home pointers, listing and deleting stay below, in
//! [`crate::Store`] and its [`crate::backend::Backend`]: only a process
//! with the store itself commits a pointer or collects garbage. Every
//! implementation passes the suite in [`crate::testing`] (behind the
//! `testing` feature).

use std::collections::HashSet;

use crate::pack::PackBuilder;
use crate::store::{Location, ObjectId, ObjectKind};
use crate::tree::{EntryKind, Tree, check_no_setid};
use crate::{Digest, Error, OrgId, Result, block};

/// An org's objects in a content store. Bytes are the stored (encoded,
/// [`block::encode`]) form; whoever reads them verifies them
/// ([`block::decode`]). Objects are write-once and content-addressed, so
/// storing one twice is harmless.
pub trait Objects: Send + Sync {
    /// Which of `objects` the org's store lacks, in the order asked. Any
    /// number may be asked; an implementation splits them into requests
    /// as it must. Errors are errors, never "absent".
    fn missing(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<ObjectId>>;

    /// Stores objects in the order given: one is stored only after every
    /// one before it, so a tree may follow the children it names (callers
    /// always give children first). A failure leaves some prefix stored.
    /// The block service checks every object before it stores any
    /// ([`put_batch_checked`]); a store this process holds trusts bytes
    /// this process encoded.
    fn put_batch(&self, org: &OrgId, objects: &[(ObjectId, &[u8])]) -> Result<()>;

    /// Stores the objects of a pack built in memory, in order, as
    /// [`Objects::put_batch`] does: push encodes a batch straight into one
    /// ([`PackBuilder::push_plain`]), which a store writing packs writes
    /// as it is, so the batch is never held twice. The default passes its
    /// objects to [`Objects::put_batch`].
    fn put_pack(&self, org: &OrgId, pack: PackBuilder) -> Result<()> {
        let objects: Vec<(ObjectId, &[u8])> = pack.objects().collect();
        if objects.is_empty() {
            return Ok(());
        }
        self.put_batch(org, &objects)
    }

    /// An object's stored bytes, unverified; `None` only when it is absent.
    fn get(&self, org: &OrgId, object: &ObjectId) -> Result<Option<Vec<u8>>>;

    /// Several objects, each as [`Objects::get`] answers it, in the order
    /// of `objects`.
    fn get_batch(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<Option<Vec<u8>>>>;

    /// [`Objects::get_batch`], each object handed to `each` (its place in
    /// `objects`, its stored bytes or `None` when absent) as soon as it is
    /// read, in no set order, so that a caller writing objects as they
    /// come never holds the batch whole. The default reads the batch,
    /// then hands it on.
    fn get_batch_each(
        &self,
        org: &OrgId,
        objects: &[ObjectId],
        each: &mut dyn FnMut(usize, Option<Vec<u8>>) -> Result<()>,
    ) -> Result<()> {
        for (i, stored) in self.get_batch(org, objects)?.into_iter().enumerate() {
            each(i, stored)?;
        }
        Ok(())
    }

    /// Whether [`Objects::get_batch`] saves round trips over one
    /// [`Objects::get`] per object. Pull then fetches every tree first and
    /// a directory's small files together; otherwise it fetches each
    /// object where it is needed, in parallel.
    fn reads_in_batches(&self) -> bool {
        false
    }

    /// Where each of `objects` lies, as far as this side knows (`None`:
    /// unknown, or stored under its own key). A pull into an empty
    /// directory reads the home's blocks sorted by it, a pack at a time.
    /// The default knows nothing (the block service's client).
    fn locations(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<Option<Location>>> {
        let _ = org;
        Ok(vec![None; objects.len()])
    }

    /// How much one [`Objects::put_batch`] should carry, in bytes and
    /// objects: push's batches. The block service takes a request's worth
    /// ([`crate::push::UPLOAD_BATCH_BYTES_MAX`]); a store writing packs
    /// takes a pack's worth, so a batch is one pack.
    fn upload_batch_limits(&self) -> (u64, usize) {
        (
            crate::push::UPLOAD_BATCH_BYTES_MAX,
            crate::push::UPLOAD_BATCH_OBJECTS_MAX,
        )
    }
}

/// The objects a tree names directly: its subtrees and its files' blocks.
pub fn children(tree: &Tree) -> Vec<ObjectId> {
    let mut children = Vec::new();
    for entry in &tree.entries {
        match &entry.kind {
            EntryKind::Dir { tree } => children.push(ObjectId::tree(*tree)),
            EntryKind::File { blocks } => {
                children.extend(blocks.iter().map(|b| ObjectId::block(*b)));
            }
            EntryKind::Symlink { .. } => {}
        }
    }
    children
}

/// Stores a tree object a client uploaded, only if every object it names
/// is already in the org's store ([`Error::IncompleteTree`] otherwise).
/// With this rule at upload, and gc deleting parents before children, a
/// present tree always has its whole subtree present, so a commit need
/// only find the root.
pub fn put_tree_checked(
    objects: &dyn Objects,
    org: &OrgId,
    digest: &Digest,
    stored: &[u8],
) -> Result<()> {
    put_batch_checked(objects, org, &[(ObjectId::tree(*digest), stored)])
}

/// The block service's rule for what it stores: objects a client uploaded
/// (their stored bytes), in the order given, after checking all of them.
/// Every object must decode to its digest ([`Error::Corrupt`]), every tree
/// must be well formed and name no setuid or setgid mode
/// ([`Error::MalformedTree`], see [`crate::tree`]) and name only objects
/// that are in the org's store or earlier in `batch`
/// ([`Error::IncompleteTree`], as [`put_tree_checked`]). Any of those
/// refuses the whole batch before anything is stored; only a store failure
/// part-way can leave some of it stored, and those objects are verified
/// and content-addressed, so they are harmless leftovers a retry finds
/// present.
pub fn put_batch_checked<B: AsRef<[u8]>>(
    objects: &dyn Objects,
    org: &OrgId,
    batch: &[(ObjectId, B)],
) -> Result<()> {
    let mut earlier: HashSet<ObjectId> = HashSet::with_capacity(batch.len());
    // Each tree with the children it names that are not earlier in the batch.
    let mut outside: Vec<(Digest, Vec<ObjectId>)> = Vec::new();
    // An object sent again in the batch is decoded and stored once.
    let mut unique: Vec<(ObjectId, &[u8])> = Vec::with_capacity(batch.len());
    let mut plain_bytes: u64 = 0;
    for (object, stored) in batch {
        if earlier.contains(object) {
            continue;
        }
        let plain = block::decode(&object.digest, stored.as_ref())?;
        // A few hundred KB of highly compressible frames would otherwise
        // cost gigabytes of decompressing and hashing on the server.
        plain_bytes += plain.len() as u64;
        if plain_bytes > BATCH_PLAIN_BYTES_MAX {
            return Err(Error::BatchTooLarge {
                plain_bytes_max: BATCH_PLAIN_BYTES_MAX,
            });
        }
        unique.push((*object, stored.as_ref()));
        if object.kind == ObjectKind::Tree {
            let tree = Tree::decode(&object.digest, &plain)?;
            check_no_setid(&object.digest, &tree)?;
            let children: Vec<ObjectId> = children(&tree)
                .into_iter()
                .filter(|child| !earlier.contains(child))
                .collect();
            if !children.is_empty() {
                outside.push((object.digest, children));
            }
        }
        earlier.insert(*object);
    }
    let mut asked: HashSet<ObjectId> = HashSet::new();
    let ask: Vec<ObjectId> = outside
        .iter()
        .flat_map(|(_, children)| children.iter().copied())
        .filter(|child| asked.insert(*child))
        .collect();
    let missing: HashSet<ObjectId> = objects.missing(org, &ask)?.into_iter().collect();
    if !missing.is_empty() {
        for (root, children) in &outside {
            let absent = children.iter().filter(|c| missing.contains(c)).count();
            if absent > 0 {
                return Err(Error::IncompleteTree {
                    root: *root,
                    missing: absent as u64,
                });
            }
        }
    }
    objects.put_batch(org, &unique)
}

/// The most plain (decompressed) bytes one checked batch may hold: a
/// client batches up to [`crate::push::UPLOAD_BATCH_BYTES_MAX`] of them
/// (one object may pass that), so this refuses only what no client sends.
pub const BATCH_PLAIN_BYTES_MAX: u64 = 64 * 1024 * 1024;
