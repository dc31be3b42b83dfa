//! The conformance suite every [`Objects`] implementation passes: the
//! store engine over each backend (`store`'s tests) and the block
//! service's client against a server in process (`server`'s tests).
//! Behind the `testing` feature, so that `store` depends on neither
//! `api` nor `server` and they depend on it only as a dev-dependency.
//!
//! The suite needs no empty store: its content is new on every run (a
//! seed from the clock and a counter), so a shared S3 bucket or server is
//! fine. It panics on the first failure, naming the check.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use crate::objects::Objects;
use crate::store::{MISSING_CHECK_BATCH_MAX, ObjectId};
use crate::tree::{Entry, EntryKind, Tree};
use crate::{Digest, OrgId, block};

/// How much the suite asks and stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// Also more objects and bytes than one request carries (of the block
    /// service, or of the store engine's existence checks), so that an
    /// implementation's splitting is checked.
    Full,
    /// A few objects per check: for a slow backend under the store engine,
    /// whose splitting is the engine's own and a `Full` run over a fast
    /// backend covers (4,000 existence checks take half a minute against
    /// the test S3 server).
    Small,
}

/// Runs every check against `objects` in the org `org`.
pub fn conformance(objects: &dyn Objects, org: &OrgId, scale: Scale) {
    let mut content = Content::new();
    missing_answers_the_absent_in_order(objects, org, scale, &mut content);
    put_then_get_returns_the_stored_bytes(objects, org, &mut content);
    a_tree_may_follow_its_children_in_one_batch(objects, org, &mut content);
    if scale == Scale::Full {
        batches_larger_than_one_request(objects, org, &mut content);
    }
    a_second_put_is_harmless(objects, org, &mut content);
}

/// Blocks no earlier run stored.
struct Content {
    seed: u64,
    next: u64,
}

impl Content {
    fn new() -> Content {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Content {
            seed: nanos
                ^ (u64::from(std::process::id()) << 32)
                ^ COUNTER.fetch_add(1, Ordering::Relaxed),
            next: 0,
        }
    }

    /// A new block of `len` plain bytes (at least 32: a prefix of this run
    /// and block makes it unique): its name, plain and stored bytes.
    fn block(&mut self, len: usize) -> Stored {
        self.next += 1;
        let mut plain = format!("{:016x}{:016x}", self.seed, self.next).into_bytes();
        plain.resize(len.max(plain.len()), 0);
        let mut state = self.seed.wrapping_add(self.next) | 1;
        for byte in &mut plain[32..] {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *byte = state as u8;
        }
        let digest = Digest::of(&plain);
        Stored {
            object: ObjectId::block(digest),
            stored: block::encode(&plain),
            plain,
        }
    }

    /// A tree naming `blocks` as one file each and `subtrees` as
    /// directories, with a name of this run so it is new too.
    fn tree(&mut self, blocks: &[&Stored], subtrees: &[&Stored]) -> Stored {
        self.next += 1;
        let mut entries = vec![Entry {
            name: format!("run-{:016x}-{}", self.seed, self.next).into_bytes(),
            mode: 0o777,
            size: 6,
            mtime_ns: 0,
            kind: EntryKind::Symlink {
                target: b"target".to_vec(),
            },
        }];
        for (i, file) in blocks.iter().enumerate() {
            entries.push(Entry {
                name: format!("file-{i}").into_bytes(),
                mode: 0o644,
                size: file.plain.len() as u64,
                mtime_ns: 0,
                kind: EntryKind::File {
                    blocks: vec![file.object.digest],
                },
            });
        }
        for (i, dir) in subtrees.iter().enumerate() {
            entries.push(Entry {
                name: format!("dir-{i}").into_bytes(),
                mode: 0o755,
                size: 0,
                mtime_ns: 0,
                kind: EntryKind::Dir {
                    tree: dir.object.digest,
                },
            });
        }
        let (digest, plain) = Tree { entries }
            .encode()
            .expect("the suite's tree is valid");
        Stored {
            object: ObjectId::tree(digest),
            stored: block::encode(&plain),
            plain,
        }
    }
}

struct Stored {
    object: ObjectId,
    plain: Vec<u8>,
    stored: Vec<u8>,
}

fn put(objects: &dyn Objects, org: &OrgId, batch: &[&Stored], what: &str) {
    let batch: Vec<(ObjectId, &[u8])> = batch
        .iter()
        .map(|s| (s.object, s.stored.as_slice()))
        .collect();
    objects
        .put_batch(org, &batch)
        .unwrap_or_else(|err| panic!("put_batch ({what}): {err}"));
}

fn ids(stored: &[&Stored]) -> Vec<ObjectId> {
    stored.iter().map(|s| s.object).collect()
}

fn missing_answers_the_absent_in_order(
    objects: &dyn Objects,
    org: &OrgId,
    scale: Scale,
    content: &mut Content,
) {
    assert_eq!(
        objects.missing(org, &[]).expect("missing of nothing"),
        Vec::new(),
        "missing of nothing"
    );
    // Present and absent interleaved irregularly, so an answer out of
    // order shows; at full scale more than one request's worth, so a
    // split shows.
    let count = match scale {
        Scale::Full => MISSING_CHECK_BATCH_MAX + 40,
        Scale::Small => 90,
    };
    let all: Vec<Stored> = (0..count).map(|_| content.block(20)).collect();
    let present: Vec<&Stored> = all
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 3 == 0 || i % 5 == 0)
        .filter(|(i, _)| *i < 120 || *i >= MISSING_CHECK_BATCH_MAX)
        .map(|(_, s)| s)
        .collect();
    put(objects, org, &present, "the present ones");
    let asked: Vec<ObjectId> = all.iter().map(|s| s.object).collect();
    let expected: Vec<ObjectId> = asked
        .iter()
        .filter(|object| !present.iter().any(|p| p.object == **object))
        .copied()
        .collect();
    assert_eq!(
        objects.missing(org, &asked).expect("missing"),
        expected,
        "missing answers exactly the absent, in the order asked"
    );
    // A tree and a block with the same digest are different objects.
    let block = &present[0];
    let as_tree = ObjectId::tree(block.object.digest);
    assert_eq!(
        objects
            .missing(org, &[block.object, as_tree])
            .expect("missing"),
        vec![as_tree],
        "kinds are separate namespaces"
    );
}

fn put_then_get_returns_the_stored_bytes(
    objects: &dyn Objects,
    org: &OrgId,
    content: &mut Content,
) {
    let blocks = [
        content.block(0),
        content.block(100),
        content.block(4096),
        content.block(1 << 20),
    ];
    let refs: Vec<&Stored> = blocks.iter().collect();
    put(objects, org, &refs, "blocks");
    for block in &blocks {
        let got = objects
            .get(org, &block.object)
            .expect("get")
            .expect("a stored block is present");
        assert_eq!(got, block.stored, "get answers the stored bytes");
        assert_eq!(
            block::decode(&block.object.digest, &got).expect("decodes"),
            block.plain
        );
    }
    let absent = content.block(64);
    assert_eq!(
        objects.get(org, &absent.object).expect("get of absent"),
        None,
        "an absent object is None, not an error"
    );
    // A batch read answers in the order asked, absent objects as `None`.
    let mut asked: Vec<ObjectId> = blocks.iter().rev().map(|b| b.object).collect();
    asked.insert(2, absent.object);
    let mut expected: Vec<Option<Vec<u8>>> = blocks
        .iter()
        .rev()
        .map(|b| Some(b.stored.clone()))
        .collect();
    expected.insert(2, None);
    assert_eq!(
        objects.get_batch(org, &asked).expect("get_batch"),
        expected,
        "get_batch"
    );
    assert_eq!(
        objects.get_batch(org, &[]).expect("get_batch of nothing"),
        Vec::<Option<Vec<u8>>>::new()
    );
    assert_eq!(
        objects.missing(org, &ids(&refs)).expect("missing"),
        Vec::new()
    );
}

fn a_tree_may_follow_its_children_in_one_batch(
    objects: &dyn Objects,
    org: &OrgId,
    content: &mut Content,
) {
    let (a, b) = (content.block(10), content.block(3000));
    let inner = content.tree(&[&a], &[]);
    let root = content.tree(&[&b], &[&inner]);
    put(
        objects,
        org,
        &[&a, &b, &inner, &root],
        "a tree after its children",
    );
    let all = ids(&[&a, &b, &inner, &root]);
    assert_eq!(objects.missing(org, &all).expect("missing"), Vec::new());
    let got = objects.get_batch(org, &all).expect("get_batch");
    let expected: Vec<Option<Vec<u8>>> = [&a, &b, &inner, &root]
        .iter()
        .map(|s| Some(s.stored.clone()))
        .collect();
    assert_eq!(got, expected, "trees and blocks read back");
    // A tree whose children an earlier batch stored.
    let top = content.tree(&[&a, &b], &[&root]);
    put(
        objects,
        org,
        &[&top],
        "a tree after a batch of its children",
    );
    assert_eq!(
        objects
            .get(org, &top.object)
            .expect("get")
            .map(|stored| block::decode(&top.object.digest, &stored).expect("decodes")),
        Some(top.plain.clone())
    );
}

/// More objects and bytes than one request of the block service carries
/// (1024 objects, 9 MiB up, 8 MiB down), in one call each way.
fn batches_larger_than_one_request(objects: &dyn Objects, org: &OrgId, content: &mut Content) {
    let mut blocks: Vec<Stored> = (0..1100).map(|i| content.block(100 + i)).collect();
    // Incompressible, so their stored size is their plain size.
    blocks.extend((0..4).map(|_| content.block(3 << 20)));
    let refs: Vec<&Stored> = blocks.iter().collect();
    let files: Vec<&Stored> = refs.iter().take(50).copied().collect();
    let tree = content.tree(&files, &[]);
    let mut batch = refs.clone();
    batch.push(&tree);
    put(objects, org, &batch, "more than one request's worth");
    let asked = ids(&batch);
    assert_eq!(objects.missing(org, &asked).expect("missing"), Vec::new());
    let got = objects.get_batch(org, &asked).expect("get_batch");
    assert_eq!(got.len(), asked.len(), "one answer per object asked");
    for (stored, got) in batch.iter().zip(&got) {
        assert!(
            got.as_ref() == Some(&stored.stored),
            "get_batch of {} objects: {:?} differs",
            asked.len(),
            stored.object
        );
    }
    // Handed on as read: each object once, the same bytes, an absent one
    // as `None`.
    let absent = content.block(77);
    let mut with_absent = asked.clone();
    with_absent.insert(3, absent.object);
    let mut each: Vec<Option<Option<Vec<u8>>>> = vec![None; with_absent.len()];
    objects
        .get_batch_each(org, &with_absent, &mut |i, stored| {
            assert!(each[i].is_none(), "object {i} handed on twice");
            each[i] = Some(stored);
            Ok(())
        })
        .expect("get_batch_each");
    let mut expected: Vec<Option<Vec<u8>>> = got;
    expected.insert(3, None);
    let each: Vec<Option<Vec<u8>>> = each
        .into_iter()
        .map(|stored| stored.expect("every object handed on"))
        .collect();
    assert!(each == expected, "get_batch_each differs from get_batch");
}

fn a_second_put_is_harmless(objects: &dyn Objects, org: &OrgId, content: &mut Content) {
    let block = content.block(5000);
    put(objects, org, &[&block], "first");
    put(objects, org, &[&block, &block], "again, twice in one batch");
    assert_eq!(
        objects.get(org, &block.object).expect("get"),
        Some(block.stored.clone())
    );
}
