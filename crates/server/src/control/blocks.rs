//! The block service's rules: an org's objects in the content store,
//! reached through the control plane (runners and CLIs hold no store
//! credentials).
//!
//! - `POST /v1/blocks/{org}/missing` `{"objects": ["blocks/HEX", …]}` →
//!   `{"missing": […]}`, at most [`MISSING_CHECK_BATCH_MAX`] per call;
//! - `PUT /v1/blocks/{org}/{blocks|trees}/{hex}`: the object's stored
//!   (framed, compressed) bytes; the server decodes them and checks the
//!   hash before storing, so a mismatching upload stores nothing (400); a
//!   tree is stored only once every object it names is there (409
//!   otherwise), so a present tree always has its whole subtree;
//! - `POST /v1/blocks/{org}/batch`: many objects in one body of frames
//!   (`api::blocks` documents the format), checked as the PUT checks one
//!   and stored in the order given, so a tree may follow its children in
//!   the same batch. This is how clients upload: one request per object
//!   cost more than the work itself on a small change;
//! - `GET` the same path: the stored bytes (the client verifies them too);
//! - `POST /v1/blocks/{org}/fetch` `{"objects": […]}`: many objects' stored
//!   bytes in one answer of frames (`api::blocks` documents it). This is
//!   how runners download: one request per object was most of a wake.
//!
//! Who may use an org's objects: that org's token, and a runner (by its
//! own credential) while it holds a sandbox of that org: one placed on it
//! and not deleted, which covers its home, its image and its snapshots.
//! Anyone else, runner tokens and the admin included: 404, as if the org
//! did not exist. The rule is checked on every request, so a runner loses
//! an org's objects as soon as its last sandbox of the org is deleted or
//! placed elsewhere.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use super::AppState;
use super::home_store::{blocking, store_error, store_of};
use crate::auth::Principal;
use crate::error::ControlError;
use crate::limits;
use api::ErrorCode;
use api::blocks::{
    FETCH_ANSWER_BYTES, FETCH_OBJECTS_MAX, absent_header, batch_header, object_name,
};
use store::pack::PackId;
use store::store::{Location, MISSING_CHECK_BATCH_MAX, ObjectId, ObjectKind};
use store::{Digest, Objects, OrgId};

/// The org whose objects `principal` may use, or 404.
pub async fn org_for(
    state: &AppState,
    principal: &Principal,
    org: &str,
) -> Result<OrgId, ControlError> {
    let not_found = || ControlError::new(ErrorCode::NotFound, "no such org");
    let parsed: OrgId = org.parse().map_err(|_| not_found())?;
    let allowed = match principal {
        Principal::Org { org_id } => org_id == org,
        Principal::Runner { runner_id } => {
            crate::records::runners::holds_org(&state.db.pool, runner_id, org).await?
        }
        Principal::Admin | Principal::RunnerEnrolment { .. } => false,
    };
    if !allowed {
        return Err(not_found());
    }
    Ok(parsed)
}

pub fn parse_object(kind: &str, hex: &str) -> Result<ObjectId, ControlError> {
    let digest: Digest = hex.parse().map_err(|_| {
        ControlError::new(
            ErrorCode::InvalidRequest,
            format!("{hex:?} is not a 64-digit hex digest"),
        )
    })?;
    match kind {
        "blocks" => Ok(ObjectId::block(digest)),
        "trees" => Ok(ObjectId::tree(digest)),
        _ => Err(ControlError::new(
            ErrorCode::NotFound,
            format!("no object kind {kind:?} (blocks or trees)"),
        )),
    }
}

/// A request body's `objects` (`blocks/HEX`, `trees/HEX`); anything else
/// is 400 naming the field.
fn parse_names(names: &[String]) -> Result<Vec<ObjectId>, ControlError> {
    names
        .iter()
        .map(|name| {
            let (kind, hex) = name.split_once('/').unwrap_or(("", name));
            parse_object(kind, hex).map_err(|_| {
                limits::invalid(
                    "objects",
                    format!("{name:?} is not blocks/HEX or trees/HEX"),
                )
            })
        })
        .collect()
}

/// Which of `names` the org's store lacks, by name.
pub async fn missing(
    state: &AppState,
    org: OrgId,
    names: &[String],
) -> Result<Vec<String>, ControlError> {
    let store = store_of(state)?;
    if names.len() > MISSING_CHECK_BATCH_MAX {
        return Err(ControlError::new(
            ErrorCode::InvalidRequest,
            format!("at most {MISSING_CHECK_BATCH_MAX} objects per request"),
        ));
    }
    let objects = parse_names(names)?;
    let missing = blocking(move || store.missing(&org, &objects))
        .await?
        .map_err(store_error)?;
    Ok(missing
        .iter()
        .map(|o| object_name(o.kind, &o.digest.to_hex()))
        .collect())
}

/// Stores one object's stored bytes once they decode to its digest (a
/// tree only once every object it names is present).
pub async fn put(
    state: &AppState,
    org: OrgId,
    object: ObjectId,
    body: Vec<u8>,
) -> Result<(), ControlError> {
    check_store_quota(state, &org).await?;
    let store = store_of(state)?;
    let size = body.len() as u64;
    let stored = blocking(move || match object.kind {
        ObjectKind::Block => store.put_encoded(&org, &object, &body),
        ObjectKind::Tree => {
            store::objects::put_tree_checked(store.as_ref(), &org, &object.digest, &body)
        }
    })
    .await?;
    match stored {
        Ok(()) => {
            state.metrics.block_transfer("in", 1, size);
            Ok(())
        }
        Err(err) => Err(upload_refused(err, &[object], "nothing stored")),
    }
}

/// Stores several objects in one request.
///
/// The body is a sequence of frames, nothing before, between or after
/// them: a header line `KIND/HEX LENGTH\n` (ASCII; KIND `blocks` or
/// `trees`, HEX the 64 lowercase hex digits of the digest, LENGTH 1 to 10
/// decimal digits), then exactly LENGTH bytes: the object's stored bytes,
/// as the single PUT carries them. At most 1024 objects and 9 MiB. Every
/// object is checked as the PUT checks it (its digest; a tree's children
/// present in the org's store or earlier in this batch) before any is
/// stored; then they are stored in the order given. A refusal (4xx)
/// stores nothing of the batch.
pub async fn put_batch(state: &AppState, org: OrgId, body: Vec<u8>) -> Result<(), ControlError> {
    check_store_quota(state, &org).await?;
    let store = store_of(state)?;
    let frames =
        api::blocks::parse_batch(&body).map_err(|err| limits::invalid("body", err.to_string()))?;
    let ids: Vec<ObjectId> = frames.iter().map(|frame| frame.object).collect();
    let size: u64 = frames.iter().map(|frame| frame.data.len() as u64).sum();
    // Checks every object before storing any. Only a store failure
    // part-way (503) leaves some of the batch stored: verified,
    // content-addressed objects that name nothing absent, which a retry
    // finds present and gc collects if nothing ever refers to them.
    let stored = blocking(move || {
        let objects: Vec<(ObjectId, &[u8])> = frames
            .iter()
            .map(|frame| (frame.object, &body[frame.data.clone()]))
            .collect();
        store::objects::put_batch_checked(store.as_ref(), &org, &objects)
    })
    .await?;
    match stored {
        Ok(()) => {
            state.metrics.block_transfer("in", ids.len() as u64, size);
            Ok(())
        }
        Err(err) => Err(upload_refused(
            err,
            &ids,
            "nothing of this batch was stored",
        )),
    }
}

/// How long a client refused for its org's stored bytes waits before it
/// tries again: room comes back with deletes and a `store gc`, not soon.
const STORE_QUOTA_RETRY_S: u64 = 60;

/// Refuses an upload while the org's objects take its bound or more
/// (`max_store_mib`): 429 `quota_exceeded`, metric `store_bytes`, in
/// bytes. Checked before each upload against what the store last listed
/// of the org's packs and this server wrote since (`Store::
/// stored_bytes`): an upload under way passes the bound by at most its
/// own bytes, and several servers' at once by theirs.
async fn check_store_quota(state: &AppState, org: &OrgId) -> Result<(), ControlError> {
    let Some(mib) = crate::records::orgs::max_store_mib(&state.db.pool, org.as_str()).await? else {
        return Ok(());
    };
    let limit = mib.saturating_mul(1 << 20);
    let store = store_of(state)?;
    let counted = org.clone();
    let current = blocking(move || store.stored_bytes(&counted))
        .await?
        .map_err(store_error)?;
    if current >= limit {
        return Err(super::admission::quota_exceeded(
            api::blocks::STORE_BYTES_METRIC,
            i64::try_from(limit).unwrap_or(i64::MAX),
            i64::try_from(current).unwrap_or(i64::MAX),
            STORE_QUOTA_RETRY_S,
        ));
    }
    Ok(())
}

/// An upload the store refused, as an answer naming the object (the first
/// of `objects` with the digest the error names).
fn upload_refused(err: store::Error, objects: &[ObjectId], stored: &str) -> ControlError {
    let name = |digest: &Digest| {
        let kind = objects
            .iter()
            .find(|o| o.digest == *digest)
            .map_or(ObjectKind::Block, |o| o.kind);
        object_name(kind, &digest.to_hex())
    };
    match err {
        store::Error::IncompleteTree { root, missing } => ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "tree {} names {missing} objects this org's store lacks: upload them first; {stored}",
                root.to_hex()
            ),
        )
        .with_details(serde_json::json!({ "missing_objects": missing, "object": name(&root) })),
        store::Error::MalformedTree { digest, reason } => ControlError::new(
            ErrorCode::InvalidRequest,
            format!("{} is not a valid tree: {reason}; {stored}", name(&digest)),
        ),
        store::Error::Corrupt { digest, reason, .. } => {
            let name = name(&digest);
            let details = match reason {
                store::Corruption::HashMismatch => serde_json::json!({ "digest_mismatch": name }),
                _ => serde_json::json!({ "undecodable": name, "reason": reason.to_string() }),
            };
            ControlError::new(
                ErrorCode::InvalidRequest,
                format!("the uploaded bytes do not decode to {name}: {reason}, {stored}"),
            )
            .with_details(details)
        }
        store::Error::BatchTooLarge { plain_bytes_max } => ControlError::new(
            ErrorCode::PayloadTooLarge,
            format!("the batch decompresses to more than {plain_bytes_max} bytes; {stored}"),
        )
        .with_details(serde_json::json!({ "plain_bytes_max": plain_bytes_max })),
        err => store_error(err),
    }
}

/// One object's stored bytes (404 naming it when absent).
pub async fn get(state: &AppState, org: OrgId, object: ObjectId) -> Result<Vec<u8>, ControlError> {
    let store = store_of(state)?;
    match blocking(move || store.get_encoded(&org, &object)).await? {
        Ok(bytes) => {
            state.metrics.block_transfer("out", 1, bytes.len() as u64);
            Ok(bytes)
        }
        Err(store::Error::MissingObject { .. }) => Err(ControlError::new(
            ErrorCode::NotFound,
            format!(
                "no object {} in this org's store",
                object_name(object.kind, &object.digest.to_hex())
            ),
        )),
        Err(err) => Err(store_error(err)),
    }
}

/// Most distinct objects read from the store per call while a fetch
/// answer is built (a store a round trip away, S3, reads them
/// concurrently).
const FETCH_READ_GROUP: usize = 64;
/// What an object whose stored length the store's pack index does not
/// give (loose, from before packs, or absent) is assumed to weigh: the
/// largest object an upload can store (`BATCH_BODY_BYTES_MAX` is the
/// single PUT's bound too), so a guess never lets a group read more than
/// planned.
const STORED_OBJECT_BYTES_MAX: u64 = api::blocks::BATCH_BODY_BYTES_MAX as u64;

/// Hands out several objects in one answer: frames in request order (the
/// batch format; an absent object is its header with `-` for a length),
/// stopping after the frame that brings the answer to about 8 MiB. The
/// client asks again for the rest.
pub async fn fetch(
    state: &AppState,
    org: OrgId,
    names: &[String],
) -> Result<Vec<u8>, ControlError> {
    let store = store_of(state)?;
    if names.is_empty() || names.len() > FETCH_OBJECTS_MAX {
        return Err(limits::invalid(
            "objects",
            format!("1 to {FETCH_OBJECTS_MAX} objects per request"),
        ));
    }
    let objects = parse_names(names)?;
    let answer = blocking(move || fetch_answer(&store, &org, &objects)).await?;
    let answer = answer.map_err(store_error)?;
    state
        .metrics
        .block_transfer("out", answer.served, answer.served_bytes);
    Ok(answer.body)
}

/// A fetch answer and what it carries (for the metrics).
struct FetchAnswer {
    body: Vec<u8>,
    served: u64,
    served_bytes: u64,
}

/// Builds a fetch answer, reading the objects a group at a time.
///
/// What one request holds is bounded by bytes, not by a guess: a group
/// is planned ([`GroupPlan`]) to read no more than the room the answer
/// has left, or one object, and an object named several times is read
/// once per group (the answer still carries a frame per name, as the
/// client expects one per object asked, in order). So the answer so far
/// and the group read stay within about [`FETCH_ANSWER_BYTES`] plus one
/// object, whatever mix of absent, small, large, scattered and repeated
/// objects is asked. Before, an average taken over absent objects let one
/// group read 64 large blocks (64 copies of one 8 MiB block: 512 MiB read
/// for an answer of 8).
fn fetch_answer(
    store: &store::Store,
    org: &OrgId,
    objects: &[ObjectId],
) -> store::Result<FetchAnswer> {
    let locations = store.locations(org, objects)?;
    let mut answer = FetchAnswer {
        body: Vec::new(),
        served: 0,
        served_bytes: 0,
    };
    let mut at = 0;
    while at < objects.len() {
        let room = FETCH_ANSWER_BYTES.saturating_sub(answer.body.len()) as u64;
        // The group: the names from `at` on whose distinct objects fit
        // `room` (the first always does).
        let mut plan = GroupPlan::default();
        let mut distinct: Vec<ObjectId> = Vec::new();
        let mut place: HashMap<ObjectId, usize> = HashMap::new();
        let mut end = at;
        while end < objects.len() {
            if let Entry::Vacant(new) = place.entry(objects[end]) {
                let fits = plan.reads_with(locations[end]) <= room;
                if !distinct.is_empty() && (!fits || distinct.len() == FETCH_READ_GROUP) {
                    break;
                }
                plan.add(locations[end]);
                new.insert(distinct.len());
                distinct.push(objects[end]);
            }
            end += 1;
        }
        let read = store.get_batch(org, &distinct)?;
        for object in &objects[at..end] {
            match &read[place[object]] {
                Some(data) => {
                    let header = batch_header(object, data.len());
                    answer.body.extend_from_slice(header.as_bytes());
                    answer.body.extend_from_slice(data);
                    answer.served += 1;
                    answer.served_bytes += data.len() as u64;
                }
                None => answer
                    .body
                    .extend_from_slice(absent_header(object).as_bytes()),
            }
            if answer.body.len() >= FETCH_ANSWER_BYTES {
                return Ok(answer);
            }
        }
        at = end;
    }
    Ok(answer)
}

/// The most a store's `get_batch` of a group's objects may read. A
/// packed object's place is known (the pack index): the store reads a
/// pack's wanted objects in ranges that may take in the bytes between
/// neighbours (one request rather than many), never beyond the first
/// wanted object's start and the last one's end, so a pack costs that
/// extent. Any other object (loose, or absent) costs
/// [`STORED_OBJECT_BYTES_MAX`].
#[derive(Default)]
struct GroupPlan {
    /// Each pack's extent in the group: its first start, its last end.
    extents: HashMap<PackId, (u64, u64)>,
    bytes: u64,
}

impl GroupPlan {
    /// What the group would read with an object at `location` added.
    fn reads_with(&self, location: Option<Location>) -> u64 {
        self.bytes.saturating_add(self.cost(location).0)
    }

    fn add(&mut self, location: Option<Location>) {
        let (cost, extent) = self.cost(location);
        self.bytes = self.bytes.saturating_add(cost);
        if let (Some(at), Some(extent)) = (location, extent) {
            self.extents.insert(at.pack, extent);
        }
    }

    /// What adding an object at `location` costs, and its pack's extent
    /// once it is added.
    fn cost(&self, location: Option<Location>) -> (u64, Option<(u64, u64)>) {
        let Some(at) = location else {
            return (STORED_OBJECT_BYTES_MAX, None);
        };
        let (start, end) = (at.offset, at.offset.saturating_add(u64::from(at.length)));
        match self.extents.get(&at.pack) {
            None => (end - start, Some((start, end))),
            Some(&(first, last)) => {
                let (first_now, last_now) = (first.min(start), last.max(end));
                (
                    (last_now - first_now) - (last - first),
                    Some((first_now, last_now)),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use store::backend::{Backend, MemoryBackend, ObjectMeta};
    use store::{Store, block};

    use super::*;

    /// A memory backend that remembers the most bytes one read handed
    /// out: what the store held at once for a group (its ranged reads of
    /// packs are one `get_ranges`, its loose objects one `get_batch`).
    #[derive(Default)]
    struct Counting {
        inner: MemoryBackend,
        largest_read_bytes: AtomicU64,
    }

    impl Counting {
        fn counted<T>(
            &self,
            read: Vec<Option<Vec<u8>>>,
            pick: impl FnOnce(Vec<Option<Vec<u8>>>) -> T,
        ) -> T {
            let bytes: usize = read.iter().flatten().map(Vec::len).sum();
            self.largest_read_bytes
                .fetch_max(bytes as u64, Ordering::Relaxed);
            pick(read)
        }
    }

    impl Backend for Counting {
        fn put(&self, key: &str, data: &[u8]) -> store::Result<()> {
            self.inner.put(key, data)
        }
        fn put_durable(&self, key: &str, data: &[u8]) -> store::Result<()> {
            self.inner.put_durable(key, data)
        }
        fn sync(&self) -> store::Result<()> {
            self.inner.sync()
        }
        fn get(&self, key: &str) -> store::Result<Option<Vec<u8>>> {
            let read = vec![self.inner.get(key)?];
            Ok(self.counted(read, |mut read| read.remove(0)))
        }
        fn get_range(&self, key: &str, offset: u64, len: u64) -> store::Result<Option<Vec<u8>>> {
            let read = vec![self.inner.get_range(key, offset, len)?];
            Ok(self.counted(read, |mut read| read.remove(0)))
        }
        fn get_batch(&self, keys: &[String]) -> store::Result<Vec<Option<Vec<u8>>>> {
            Ok(self.counted(self.inner.get_batch(keys)?, |read| read))
        }
        fn get_ranges(&self, ranges: &[(String, u64, u64)]) -> store::Result<Vec<Option<Vec<u8>>>> {
            Ok(self.counted(self.inner.get_ranges(ranges)?, |read| read))
        }
        fn exists(&self, keys: &[String]) -> store::Result<Vec<bool>> {
            self.inner.exists(keys)
        }
        fn list(&self, prefix: &str) -> store::Result<Vec<ObjectMeta>> {
            self.inner.list(prefix)
        }
        fn head(&self, key: &str) -> store::Result<Option<ObjectMeta>> {
            self.inner.head(key)
        }
        fn delete(&self, key: &str) -> store::Result<()> {
            self.inner.delete(key)
        }
    }

    /// Incompressible bytes, different for each `seed`.
    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// A store over a counting backend holding `plains` as blocks, packed
    /// in this order.
    fn store_with(plains: &[Vec<u8>]) -> (Arc<Counting>, Store, OrgId, Vec<ObjectId>) {
        let backend = Arc::new(Counting::default());
        let store = Store::new(backend.clone());
        let org: OrgId = "acme".parse().expect("an org id");
        let encoded: Vec<(ObjectId, Vec<u8>)> = plains
            .iter()
            .map(|plain| (ObjectId::block(Digest::of(plain)), block::encode(plain)))
            .collect();
        let batch: Vec<(ObjectId, &[u8])> = encoded.iter().map(|(o, b)| (*o, &b[..])).collect();
        store.put_batch(&org, &batch).expect("stored");
        let ids = encoded.iter().map(|(o, _)| *o).collect();
        (backend, store, org, ids)
    }

    /// Fetches `asked` and checks the answer: a prefix of it, in order,
    /// with the right bytes, no larger than the bound and one object; and
    /// that no read of the store for it held more than the answer's room
    /// or one object. Returns how many frames it carries.
    fn fetched(backend: &Counting, store: &Store, org: &OrgId, asked: &[ObjectId]) -> usize {
        backend.largest_read_bytes.store(0, Ordering::Relaxed);
        let answer = fetch_answer(store, org, asked).expect("an answer");
        let largest = backend.largest_read_bytes.load(Ordering::Relaxed);
        assert!(
            largest <= STORED_OBJECT_BYTES_MAX,
            "{largest} bytes read at once for one answer"
        );
        assert!(answer.body.len() as u64 <= FETCH_ANSWER_BYTES as u64 + STORED_OBJECT_BYTES_MAX);
        let frames = api::blocks::parse_fetched(&answer.body).expect("frames");
        assert!(!frames.is_empty() && frames.len() <= asked.len());
        for (frame, wanted) in frames.iter().zip(asked) {
            assert_eq!(frame.object, *wanted, "frames in request order");
            let expected = store.get(org, wanted).expect("get");
            let got = frame.data.clone().map(|range| answer.body[range].to_vec());
            assert_eq!(got, expected);
        }
        frames.len()
    }

    /// Audit finding: after absent objects the average size was 1 byte, so
    /// the next group read 64 objects whatever their size, and a name
    /// repeated 64 times was read 64 times, for an answer carrying a few.
    /// A group now reads the answer's room or one object at most, counting
    /// what the store reads between the objects of one pack.
    #[test]
    fn a_fetch_reads_about_its_answer_whatever_it_asks() {
        let absent: Vec<ObjectId> = (0..8u8)
            .map(|i| ObjectId::block(Digest::of(&[i])))
            .collect();

        // The audit's request: absent objects, then one block 64 times.
        let (backend, store, org, ids) = store_with(&[noise(1024 * 1024, 1)]);
        let mut asked = absent.clone();
        asked.extend(std::iter::repeat_n(ids[0], 64));
        assert!(
            fetched(&backend, &store, &org, &asked) > 8,
            "the block is answered"
        );

        // Distinct large objects after small ones.
        let mut plains: Vec<Vec<u8>> = (0..8).map(|i| noise(100, i)).collect();
        plains.extend((0..40).map(|i| noise(512 * 1024, 100 + i)));
        let (backend, store, org, ids) = store_with(&plains);
        fetched(&backend, &store, &org, &ids);

        // Small objects far apart in their packs, with little room left:
        // the bytes between them count.
        let mut plains = vec![noise(7_700_000, 1)];
        for i in 0..64 {
            plains.push(noise(4096, 10 + i));
            plains.push(noise(250 * 1024, 1000 + i));
        }
        let (backend, store, org, ids) = store_with(&plains);
        let mut asked = vec![ids[0]];
        asked.extend(ids[1..].iter().step_by(2));
        assert_eq!(fetched(&backend, &store, &org, &asked), asked.len());

        // Repeated small objects are still each answered, in order.
        let (backend, store, org, ids) = store_with(&[noise(10, 1), noise(10, 2)]);
        let asked = [ids[0], ids[1], ids[0], absent[0], ids[0], absent[0]];
        assert_eq!(fetched(&backend, &store, &org, &asked), asked.len());
    }
}
