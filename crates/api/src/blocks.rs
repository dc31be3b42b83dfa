//! The block service (`/v1/blocks/{org}/…`): the content store, reached
//! through the control plane so that runners and CLIs never hold store
//! credentials. Objects are addressed `{kind}/{hex}` with kind `blocks` or
//! `trees`, the layout of the store's own keys.
//!
//! [`RemoteBackend`] is this service's client, a [`store::Objects`], so
//! the store engine's upload and materialise run unchanged against it
//! (and it passes the same conformance suite as the store engine, in the
//! server's tests). Objects only: home pointers are committed by the
//! server, which alone can take the store's commit lock. Its `missing`
//! asks in requests of at most 4096 (`POST …/missing`), its `put_batch`
//! sends many objects per request (`POST …/batch`, the body format below),
//! and its `get_batch` fetches many (`POST …/fetch`).
//!
//! # Batch body
//!
//! `POST /v1/blocks/{org}/batch` carries a sequence of frames, with
//! nothing before, between or after them:
//!
//! ```text
//! frame  = header data
//! header = kind "/" hex " " length "\n"     (ASCII, at most 96 bytes)
//! kind   = "blocks" | "trees"
//! hex    = 64 lowercase hex digits: the digest of the plain content
//! length = 1 to 10 decimal digits: the byte count of data
//! data   = the object's stored (framed, compressed) bytes, exactly what
//!          PUT /v1/blocks/{org}/{kind}/{hex} would carry
//! ```
//!
//! At most [`BATCH_OBJECTS_MAX`] frames and [`BATCH_BODY_BYTES_MAX`] bytes.
//! The server stores the objects in the order given, so a tree may follow
//! the children it names in the same batch.
//!
//! # Fetch answer
//!
//! `POST /v1/blocks/{org}/fetch` `{"objects": ["blocks/HEX", …]}` (at most
//! [`FETCH_OBJECTS_MAX`]) answers with frames in the same format, one per
//! requested object in request order, where an object the org's store
//! lacks is a header alone with `-` for its length (`blocks/HEX -\n`). The
//! answer may stop early, after at least one frame, once it holds about
//! [`FETCH_ANSWER_BYTES`]: the client asks again for the rest.

use std::collections::HashSet;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use store::store::{MISSING_CHECK_BATCH_MAX, ObjectId, ObjectKind};
use store::{Digest, Objects, OrgId, Store};

use crate::ErrorCode;
use crate::client::{Client, ClientError};

/// `POST /v1/blocks/{org}/missing`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MissingRequest {
    /// `blocks/HEX` or `trees/HEX`; at most 4096.
    pub objects: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MissingResponse {
    /// The requested objects the org's store lacks, in request order.
    pub missing: Vec<String>,
}

/// `POST /v1/blocks/{org}/fetch`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FetchRequest {
    /// `blocks/HEX` or `trees/HEX`; at most 1024.
    pub objects: Vec<String>,
}

/// Most objects one fetch may ask for.
pub const FETCH_OBJECTS_MAX: usize = 1024;
/// A fetch answer stops after the frame that brings it to this size.
pub const FETCH_ANSWER_BYTES: usize = 8 * 1024 * 1024;

/// How the service names an object: `blocks/HEX` or `trees/HEX`.
pub fn object_name(kind: ObjectKind, hex: &str) -> String {
    match kind {
        ObjectKind::Block => format!("blocks/{hex}"),
        ObjectKind::Tree => format!("trees/{hex}"),
    }
}

/// Largest batch body: the single-object body limit, so any object whose
/// PUT fits fits a batch alone but for its header.
pub const BATCH_BODY_BYTES_MAX: usize = 9 * 1024 * 1024;
/// Most objects in one batch.
pub const BATCH_OBJECTS_MAX: usize = 1024;
/// Longest frame header: `trees/` + 64 hex + ` ` + 10 digits + `\n` is 82.
const BATCH_HEADER_BYTES_MAX: usize = 96;
const BATCH_LENGTH_DIGITS_MAX: usize = 10;

/// A frame's header for an object of `stored_len` stored bytes.
pub fn batch_header(object: &ObjectId, stored_len: usize) -> String {
    format!(
        "{} {stored_len}\n",
        object_name(object.kind, &object.digest.to_hex())
    )
}

/// One object of a batch body: what it claims to be, and where its stored
/// bytes are in the body. Nothing here is verified against the digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchObject {
    pub object: ObjectId,
    pub data: Range<usize>,
}

/// Why a batch body is not a sequence of frames (objects counted from 0).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BatchFormatError {
    #[error("object {index}: the body ends inside its header")]
    TruncatedHeader { index: usize },
    #[error(
        "object {index}: malformed header {header:?}: expected \"{{blocks|trees}}/HEX LENGTH\\n\""
    )]
    MalformedHeader { index: usize, header: String },
    #[error("object {index}: unknown object kind {kind:?} (blocks or trees)")]
    UnknownKind { index: usize, kind: String },
    #[error("object {index}: {hex:?} is not a 64-digit lowercase hex digest")]
    InvalidDigest { index: usize, hex: String },
    #[error("object {index}: the body ends {missing} bytes short of its length {length}")]
    TruncatedData {
        index: usize,
        length: usize,
        missing: usize,
    },
    #[error("more than {BATCH_OBJECTS_MAX} objects")]
    TooManyObjects,
}

/// Splits a batch body into its frames (see the module documentation),
/// refusing anything else: a body that ends inside a frame, a header that
/// is not exactly `kind/hex length\n`, more than [`BATCH_OBJECTS_MAX`].
pub fn parse_batch(body: &[u8]) -> Result<Vec<BatchObject>, BatchFormatError> {
    Ok(parse_frames(body, false)?
        .into_iter()
        .filter_map(|frame| {
            Some(BatchObject {
                object: frame.object,
                data: frame.data?,
            })
        })
        .collect())
}

/// One object of a fetch answer; `data` is `None` for an object the
/// org's store lacks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchedObject {
    pub object: ObjectId,
    pub data: Option<Range<usize>>,
}

/// Splits a fetch answer into its frames: the batch format, where a length
/// of `-` says the object is absent.
pub fn parse_fetched(body: &[u8]) -> Result<Vec<FetchedObject>, BatchFormatError> {
    parse_frames(body, true)
}

/// An absent object's frame in a fetch answer.
pub fn absent_header(object: &ObjectId) -> String {
    format!("{} -\n", object_name(object.kind, &object.digest.to_hex()))
}

/// The frames of a body; `-` lengths (absent objects) only where
/// `allow_absent`.
fn parse_frames(body: &[u8], allow_absent: bool) -> Result<Vec<FetchedObject>, BatchFormatError> {
    let mut objects = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let index = objects.len();
        if index == BATCH_OBJECTS_MAX {
            return Err(BatchFormatError::TooManyObjects);
        }
        let rest = &body[at..];
        let window = &rest[..rest.len().min(BATCH_HEADER_BYTES_MAX)];
        let Some(end) = window.iter().position(|&b| b == b'\n') else {
            if rest.len() < BATCH_HEADER_BYTES_MAX {
                return Err(BatchFormatError::TruncatedHeader { index });
            }
            return Err(BatchFormatError::MalformedHeader {
                index,
                header: String::from_utf8_lossy(window).into_owned(),
            });
        };
        let header = &window[..end];
        let malformed = || BatchFormatError::MalformedHeader {
            index,
            header: String::from_utf8_lossy(header).into_owned(),
        };
        let text = std::str::from_utf8(header).map_err(|_| malformed())?;
        let (name, length) = text.split_once(' ').ok_or_else(malformed)?;
        let (kind, hex) = name.split_once('/').ok_or_else(malformed)?;
        let absent = allow_absent && length == "-";
        if !absent
            && (length.is_empty()
                || length.len() > BATCH_LENGTH_DIGITS_MAX
                || !length.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err(malformed());
        }
        let digest: Digest = hex.parse().map_err(|_| BatchFormatError::InvalidDigest {
            index,
            hex: hex.chars().take(80).collect(),
        })?;
        let object = match kind {
            "blocks" => ObjectId::block(digest),
            "trees" => ObjectId::tree(digest),
            _ => {
                return Err(BatchFormatError::UnknownKind {
                    index,
                    kind: kind.chars().take(80).collect(),
                });
            }
        };
        let start = at + end + 1;
        if absent {
            objects.push(FetchedObject { object, data: None });
            at = start;
            continue;
        }
        let length: usize = length.parse().map_err(|_| malformed())?;
        let available = body.len() - start;
        if length > available {
            return Err(BatchFormatError::TruncatedData {
                index,
                length,
                missing: length - available,
            });
        }
        objects.push(FetchedObject {
            object,
            data: Some(start..start + length),
        });
        at = start + length;
    }
    Ok(objects)
}

/// The block service's client: an org's objects ([`Objects`]) through
/// the control plane, for runners and CLIs that hold no store credentials.
/// Its methods block: call them from plain threads (rayon's, or
/// `spawn_blocking`), never from async code.
pub struct RemoteBackend {
    client: Client,
    runtime: tokio::runtime::Handle,
}

impl RemoteBackend {
    /// `runtime` runs the HTTP calls; the caller's threads wait on them.
    pub fn new(client: Client, runtime: tokio::runtime::Handle) -> RemoteBackend {
        RemoteBackend { client, runtime }
    }

    /// Sends the batch being built, if it holds anything, and empties it.
    fn send_batch(&self, org: &OrgId, batch: &mut PendingBatch) -> store::Result<()> {
        let Some(first) = batch.first.take() else {
            return Ok(());
        };
        let body = std::mem::take(&mut batch.body);
        batch.objects = 0;
        self.runtime
            .block_on(self.client.put_objects(org.as_str(), body))
            .map_err(|e| backend_error("put", org, &first, e))
    }

    /// One object through the single `PUT`.
    fn put(&self, org: &OrgId, object: &ObjectId, stored: &[u8]) -> store::Result<()> {
        self.runtime
            .block_on(
                self.client
                    .put_object(org.as_str(), &name_of(object), stored.to_vec()),
            )
            .map_err(|e| backend_error("put", org, object, e))
    }
}

/// A batch body being built by [`RemoteBackend`]'s `put_batch`.
#[derive(Default)]
struct PendingBatch {
    body: Vec<u8>,
    objects: usize,
    /// The first object, named in errors; `None` while the batch is empty.
    first: Option<ObjectId>,
}

fn name_of(object: &ObjectId) -> String {
    object_name(object.kind, &object.digest.to_hex())
}

/// A failed call, named as the store names the object (its key), so the
/// message reads as a store error does. The store full (507) and the
/// org past its bound on the store (429 `quota_exceeded`, metric
/// `store_bytes`) are both [`store::Error::StoreFull`]: nothing was
/// stored, and trying again helps only once room is freed. (Another 429,
/// the org's requests at once, passes in a second: not full.)
fn backend_error(
    op: &'static str,
    org: &OrgId,
    object: &ObjectId,
    err: ClientError,
) -> store::Error {
    let key = Store::object_key(org, object);
    let message = err.to_string();
    if err.code() == Some(ErrorCode::InsufficientStorage)
        || err.quota_metric() == Some(STORE_BYTES_METRIC)
    {
        return store::Error::StoreFull { op, key, message };
    }
    store::Error::Backend { op, key, message }
}

/// The quota metric of an org's bound on its stored bytes, as a 429
/// `quota_exceeded` names it.
pub const STORE_BYTES_METRIC: &str = "store_bytes";

/// Fetch requests one [`RemoteBackend::get_batch`] keeps in flight.
const FETCH_IN_FLIGHT: usize = 4;

/// `objects` through `POST …/fetch`, one request per
/// [`FETCH_OBJECTS_MAX`], repeated for whatever an answer left out. Every
/// frame must be the next object asked for.
async fn fetch_run(
    client: Client,
    org: OrgId,
    objects: Vec<ObjectId>,
) -> store::Result<Vec<Option<Vec<u8>>>> {
    let mut out = Vec::with_capacity(objects.len());
    while out.len() < objects.len() {
        let asked = &objects[out.len()..objects.len().min(out.len() + FETCH_OBJECTS_MAX)];
        let first = &asked[0];
        let names: Vec<String> = asked.iter().map(name_of).collect();
        let body = client
            .fetch_objects(org.as_str(), &names)
            .await
            .map_err(|e| backend_error("get", &org, first, e))?;
        let bad = |message: String| store::Error::Backend {
            op: "get",
            key: Store::object_key(&org, first),
            message: format!("malformed fetch answer: {message}"),
        };
        let frames = parse_fetched(&body).map_err(|e| bad(e.to_string()))?;
        if frames.is_empty() || frames.len() > asked.len() {
            return Err(bad(format!(
                "{} objects for {} asked",
                frames.len(),
                asked.len()
            )));
        }
        for (frame, wanted) in frames.into_iter().zip(asked) {
            if frame.object != *wanted {
                return Err(bad(format!(
                    "{} where {} was next",
                    name_of(&frame.object),
                    name_of(wanted)
                )));
            }
            out.push(frame.data.map(|range| body[range].to_vec()));
        }
    }
    Ok(out)
}

impl Objects for RemoteBackend {
    /// One request per [`MISSING_CHECK_BATCH_MAX`] objects.
    fn missing(&self, org: &OrgId, objects: &[ObjectId]) -> store::Result<Vec<ObjectId>> {
        let mut missing = Vec::new();
        for batch in objects.chunks(MISSING_CHECK_BATCH_MAX) {
            let names: Vec<String> = batch.iter().map(name_of).collect();
            let absent: HashSet<String> = self
                .runtime
                .block_on(self.client.missing_objects(org.as_str(), &names))
                .map_err(|e| backend_error("exists", org, &batch[0], e))?
                .into_iter()
                .collect();
            missing.extend(
                batch
                    .iter()
                    .zip(&names)
                    .filter(|(_, name)| absent.contains(*name))
                    .map(|(object, _)| *object),
            );
        }
        Ok(missing)
    }

    /// One request per run of objects that fits [`BATCH_BODY_BYTES_MAX`]
    /// and [`BATCH_OBJECTS_MAX`], sent one after the other so the order
    /// holds across requests too; an object too large for any batch goes
    /// alone through the single PUT, in its place.
    fn put_batch(&self, org: &OrgId, objects: &[(ObjectId, &[u8])]) -> store::Result<()> {
        let mut batch = PendingBatch::default();
        for (object, data) in objects {
            let header = batch_header(object, data.len());
            let frame_bytes = header.len() + data.len();
            if frame_bytes > BATCH_BODY_BYTES_MAX {
                self.send_batch(org, &mut batch)?;
                self.put(org, object, data)?;
                continue;
            }
            if batch.objects == BATCH_OBJECTS_MAX
                || batch.body.len() + frame_bytes > BATCH_BODY_BYTES_MAX
            {
                self.send_batch(org, &mut batch)?;
            }
            batch.first.get_or_insert(*object);
            batch.body.reserve(frame_bytes);
            batch.body.extend_from_slice(header.as_bytes());
            batch.body.extend_from_slice(data);
            batch.objects += 1;
        }
        self.send_batch(org, &mut batch)
    }

    fn get(&self, org: &OrgId, object: &ObjectId) -> store::Result<Option<Vec<u8>>> {
        self.runtime
            .block_on(self.client.get_object(org.as_str(), &name_of(object)))
            .map_err(|e| backend_error("get", org, object, e))
    }

    /// [`Objects::get_batch_each`], collected.
    fn get_batch(&self, org: &OrgId, objects: &[ObjectId]) -> store::Result<Vec<Option<Vec<u8>>>> {
        let mut out = vec![None; objects.len()];
        self.get_batch_each(org, objects, &mut |i, stored| {
            out[i] = stored;
            Ok(())
        })?;
        Ok(out)
    }

    /// Split into up to [`FETCH_IN_FLIGHT`] runs of at most
    /// [`FETCH_OBJECTS_MAX`] objects, fetched at once (the server reads
    /// one run's packs while another's answer crosses the wire and the
    /// caller writes), each run's objects handed on in order as its answer
    /// arrives while the later runs are still in flight.
    fn get_batch_each(
        &self,
        org: &OrgId,
        objects: &[ObjectId],
        each: &mut dyn FnMut(usize, Option<Vec<u8>>) -> store::Result<()>,
    ) -> store::Result<()> {
        let per_run = objects
            .len()
            .div_ceil(FETCH_IN_FLIGHT)
            .clamp(1, FETCH_OBJECTS_MAX);
        let mut runs = objects.chunks(per_run);
        let mut handed = 0;
        self.runtime.block_on(async {
            let mut in_flight = std::collections::VecDeque::new();
            let result = loop {
                while in_flight.len() < FETCH_IN_FLIGHT
                    && let Some(run) = runs.next()
                {
                    let (client, org, run) = (self.client.clone(), org.clone(), run.to_vec());
                    in_flight.push_back(self.runtime.spawn(fetch_run(client, org, run)));
                }
                let Some(next) = in_flight.pop_front() else {
                    break Ok(());
                };
                let answered = next.await.unwrap_or_else(|join| {
                    Err(store::Error::Backend {
                        op: "get",
                        key: Store::object_key(org, &objects[handed]),
                        message: format!("fetch task failed: {join}"),
                    })
                });
                let handing = answered.and_then(|fetched| {
                    fetched.into_iter().try_for_each(|stored| {
                        each(handed, stored)?;
                        handed += 1;
                        Ok(())
                    })
                });
                if let Err(err) = handing {
                    break Err(err);
                }
            };
            // On an error nobody will read the rest: stop asking for it.
            in_flight.iter().for_each(tokio::task::JoinHandle::abort);
            result
        })
    }

    fn reads_in_batches(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Full is the store's 507 or the org's bound on its stored bytes; the
    /// org's other 429 (its requests at once) passes in a second.
    #[test]
    fn only_room_refusals_are_a_full_store() {
        let org: OrgId = "acme".parse().expect("an org");
        let object = ObjectId::block(store::Digest::of(b"x"));
        let refused = |code: ErrorCode, metric: Option<&str>| ClientError::Api {
            status: code.status(),
            code,
            message: "refused".to_owned(),
            request_id: "req".to_owned(),
            details: metric.map_or(
                serde_json::Value::Null,
                |metric| serde_json::json!({"quota": {"metric": metric}}),
            ),
        };
        let full = |err| backend_error("put", &org, &object, err).is_store_full();
        assert!(full(refused(ErrorCode::InsufficientStorage, None)));
        assert!(full(refused(
            ErrorCode::QuotaExceeded,
            Some(STORE_BYTES_METRIC)
        )));
        assert!(!full(refused(
            ErrorCode::QuotaExceeded,
            Some("requests_at_once")
        )));
        assert!(!full(refused(ErrorCode::Unavailable, None)));
    }

    fn frame(kind: &str, hex: &str, length: &str, data: &[u8]) -> Vec<u8> {
        let mut out = format!("{kind}/{hex} {length}\n").into_bytes();
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn batch_bodies_parse_into_their_frames() {
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let frames = [
            (ObjectId::block(a), &b"xyz"[..]),
            (ObjectId::tree(b), &b""[..]),
            (ObjectId::block(b), &b"\n\n"[..]),
        ];
        let mut body = Vec::new();
        let mut expected = Vec::new();
        for (object, data) in frames {
            let header = batch_header(&object, data.len());
            assert!(header.len() <= BATCH_HEADER_BYTES_MAX);
            body.extend_from_slice(header.as_bytes());
            expected.push(BatchObject {
                object,
                data: body.len()..body.len() + data.len(),
            });
            body.extend_from_slice(data);
        }
        assert_eq!(
            &body[..74],
            frame("blocks", &a.to_hex(), "3", b"").as_slice()
        );
        assert_eq!(parse_batch(&body), Ok(expected));
        assert_eq!(parse_batch(b""), Ok(Vec::new()));
    }

    #[test]
    fn fetch_answers_name_absent_objects_which_batches_may_not() {
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let mut body = batch_header(&ObjectId::block(a), 2).into_bytes();
        let header_len = body.len();
        body.extend_from_slice(b"xy");
        body.extend_from_slice(absent_header(&ObjectId::tree(b)).as_bytes());
        assert_eq!(
            parse_fetched(&body),
            Ok(vec![
                FetchedObject {
                    object: ObjectId::block(a),
                    data: Some(header_len..header_len + 2),
                },
                FetchedObject {
                    object: ObjectId::tree(b),
                    data: None,
                },
            ])
        );
        let absent = format!("trees/{} -", b.to_hex());
        assert_eq!(
            parse_batch(&body),
            Err(BatchFormatError::MalformedHeader {
                index: 1,
                header: absent,
            })
        );
    }

    #[test]
    fn hostile_batch_bodies_are_refused() {
        let hex = Digest::of(b"a").to_hex();
        let check = |body: Vec<u8>, expected: BatchFormatError| {
            assert_eq!(
                parse_batch(&body),
                Err(expected),
                "{:?}",
                String::from_utf8_lossy(&body)
            );
        };
        let good = frame("blocks", &hex, "1", b"x");
        let header = |h: &str| BatchFormatError::MalformedHeader {
            index: 1,
            header: h.to_owned(),
        };
        let after_good = |rest: &[u8]| [&good[..], rest].concat();
        check(
            after_good(b"blocks/abc"),
            BatchFormatError::TruncatedHeader { index: 1 },
        );
        check(
            after_good(&frame("blocks", &hex, "5", b"abc")),
            BatchFormatError::TruncatedData {
                index: 1,
                length: 5,
                missing: 2,
            },
        );
        check(
            after_good(&frame("snapshots", &hex, "1", b"x")),
            BatchFormatError::UnknownKind {
                index: 1,
                kind: "snapshots".to_owned(),
            },
        );
        check(
            after_good(&frame("blocks", &hex.to_uppercase(), "1", b"x")),
            BatchFormatError::InvalidDigest {
                index: 1,
                hex: hex.to_uppercase(),
            },
        );
        for length in ["", "-1", "+1", "1 ", "12345678901", "0x1"] {
            let h = format!("blocks/{hex} {length}");
            check(after_good(format!("{h}\n").as_bytes()), header(&h));
        }
        check(after_good(b"blocks 1\nx"), header("blocks 1"));
        check(after_good(b"\n"), header(""));
        // No newline within the longest header: malformed, not "truncated".
        let long = vec![b'a'; 200];
        check(
            after_good(&long),
            BatchFormatError::MalformedHeader {
                index: 1,
                header: String::from_utf8_lossy(&long[..96]).into_owned(),
            },
        );
        let many: Vec<u8> = (0..=BATCH_OBJECTS_MAX).flat_map(|_| good.clone()).collect();
        check(many, BatchFormatError::TooManyObjects);
        let most: Vec<u8> = (0..BATCH_OBJECTS_MAX).flat_map(|_| good.clone()).collect();
        assert_eq!(parse_batch(&most).map(|o| o.len()), Ok(BATCH_OBJECTS_MAX));
    }
}
