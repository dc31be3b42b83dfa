//! Property-based fuzzing of the block service's frame parsers: the batch
//! body a client uploads (`parse_batch`, run by the server on every
//! `POST …/batch`) and the fetch answer a client reads (`parse_fetched`).
//!
//! Generators build bodies frame by frame from parts at and past each
//! bound (kinds, digests of every wrong shape, lengths that are too long,
//! too short, padded, signed, `-`, eleven digits), runs of frames around
//! [`BATCH_OBJECTS_MAX`], and valid bodies broken byte by byte. Properties:
//! no panic; a refusal is a [`BatchFormatError`] with a one-line message;
//! what parses is at most [`BATCH_OBJECTS_MAX`] frames whose data ranges
//! follow each other inside the body (the parsers copy nothing, so no
//! declared length can make them allocate), and written out again it
//! parses to the same objects and bytes; a batch never holds an absent
//! object; valid bodies parse to what was written.
//!
//! Each target runs a bounded number of cases (well under a second in a
//! debug build); `PROPTEST_CASES=100000 cargo test -p api --test it fuzz::`
//! runs them longer. A failing case is saved under `proptest-regressions/`
//! and replayed first on every later run.

use api::blocks::{
    BATCH_OBJECTS_MAX, BatchFormatError, FetchedObject, absent_header, batch_header, parse_batch,
    parse_fetched,
};
use proptest::prelude::*;
use proptest::sample::Index;
use store::Digest;
use store::store::ObjectId;

/// `cases` unless `PROPTEST_CASES` asks for another number.
fn config(cases: u32) -> ProptestConfig {
    let mut config = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = cases;
    }
    config
}

/// One frame's parts, each possibly wrong.
#[derive(Clone, Debug)]
struct Frame {
    kind: String,
    hex: String,
    length: Length,
    data: Vec<u8>,
}

#[derive(Clone, Debug)]
enum Length {
    /// The data's length, as `batch_header` writes it.
    Exact,
    /// The data's length plus this (past the end of the body, or short).
    Off(i64),
    /// Written as given.
    Text(String),
}

fn kind() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["blocks", "trees"]).prop_map(str::to_owned),
        1 => prop::sample::select(vec!["", "BLOCKS", "snapshots", "blocks/trees", "tr\u{e9}es"])
            .prop_map(str::to_owned),
    ]
}

fn hex() -> impl Strategy<Value = String> {
    let valid = any::<[u8; 32]>().prop_map(|d| Digest(d).to_hex());
    prop_oneof![
        4 => valid.clone(),
        1 => valid.clone().prop_map(|h| h.to_uppercase()),
        1 => valid.clone().prop_map(|h| h[..63].to_owned()),
        1 => valid.clone().prop_map(|h| format!("{h}0")),
        // 64 bytes, but not 64 characters: a multi-byte character where a
        // hex digit should be.
        1 => valid.prop_map(|h| format!("\u{e9}{}", &h[2..])),
        1 => "[ -~]{0,100}",
    ]
}

fn length() -> impl Strategy<Value = Length> {
    prop_oneof![
        6 => Just(Length::Exact),
        2 => prop::sample::select(vec![-2i64, -1, 1, 2, 1 << 20, u32::MAX as i64])
            .prop_map(Length::Off),
        2 => prop::sample::select(vec![
            "", "-", "+1", "-1", " 1", "1 ", "0x1", "00", "007", "9999999999", "99999999999",
            "18446744073709551616", "\u{661}",
        ])
        .prop_map(|text| Length::Text(text.to_owned())),
    ]
}

fn frame() -> impl Strategy<Value = Frame> {
    (
        kind(),
        hex(),
        length(),
        prop::collection::vec(any::<u8>(), 0..40),
    )
        .prop_map(|(kind, hex, length, data)| Frame {
            kind,
            hex,
            length,
            data,
        })
}

fn write(frames: &[Frame]) -> Vec<u8> {
    let mut body = Vec::new();
    for frame in frames {
        let length = match &frame.length {
            Length::Exact => frame.data.len().to_string(),
            Length::Off(off) => (frame.data.len() as i64 + off).max(0).to_string(),
            Length::Text(text) => text.clone(),
        };
        body.extend_from_slice(format!("{}/{} {length}\n", frame.kind, frame.hex).as_bytes());
        if length != "-" {
            body.extend_from_slice(&frame.data);
        }
    }
    body
}

/// A valid object and its stored bytes (or `None`: absent, in a fetch).
fn object() -> impl Strategy<Value = (ObjectId, Option<Vec<u8>>)> {
    (
        any::<[u8; 32]>(),
        any::<bool>(),
        prop::option::weighted(0.9, prop::collection::vec(any::<u8>(), 0..40)),
    )
        .prop_map(|(digest, tree, data)| {
            let digest = Digest(digest);
            let object = if tree {
                ObjectId::tree(digest)
            } else {
                ObjectId::block(digest)
            };
            (object, data)
        })
}

/// A body as the server writes a fetch answer (absent objects as `-`) or a
/// client a batch (with `absent` false).
fn valid_body(objects: &[(ObjectId, Option<Vec<u8>>)], absent: bool) -> Vec<u8> {
    let mut body = Vec::new();
    for (object, data) in objects {
        match data {
            Some(data) => {
                body.extend_from_slice(batch_header(object, data.len()).as_bytes());
                body.extend_from_slice(data);
            }
            None if absent => body.extend_from_slice(absent_header(object).as_bytes()),
            None => body.extend_from_slice(batch_header(object, 0).as_bytes()),
        }
    }
    body
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    Insert(Index, u8),
    Delete(Index),
    Truncate(Index),
}

fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for mutation in mutations {
        let len = bytes.len();
        match mutation {
            Mutation::Flip(at, bit) if len > 0 => bytes[at.index(len)] ^= 1u8 << bit,
            Mutation::Insert(at, byte) => bytes.insert(at.index(len + 1), *byte),
            Mutation::Delete(at) if len > 0 => {
                bytes.remove(at.index(len));
            }
            Mutation::Truncate(at) => bytes.truncate(at.index(len + 1)),
            _ => {}
        }
    }
    bytes
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        // Bytes that matter to the grammar, besides any byte.
        (any::<Index>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip(at, bit)),
        (
            any::<Index>(),
            prop_oneof![
                prop::sample::select(b"\n /-0123456789abcdef".to_vec()),
                any::<u8>()
            ]
        )
            .prop_map(|(at, byte)| Mutation::Insert(at, byte)),
        any::<Index>().prop_map(Mutation::Delete),
        any::<Index>().prop_map(Mutation::Truncate),
    ]
}

/// Bodies either parser may be handed.
fn hostile_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => prop::collection::vec(frame(), 0..6).prop_map(|frames| write(&frames)),
        3 => (
            prop::collection::vec(object(), 0..8),
            any::<bool>(),
            prop::collection::vec(mutation(), 1..5)
        )
            .prop_map(|(objects, absent, mutations)| {
                mutate(valid_body(&objects, absent), &mutations)
            }),
        // Runs of frames around the count bound, the last one possibly
        // broken.
        1 => (
            prop::sample::select(vec![
                BATCH_OBJECTS_MAX - 1,
                BATCH_OBJECTS_MAX,
                BATCH_OBJECTS_MAX + 1
            ]),
            object(),
            any::<bool>(),
            frame(),
        )
            .prop_map(|(count, object, absent, last)| {
                let mut body = valid_body(&vec![object; count - 1], absent);
                body.extend_from_slice(&write(&[last]));
                body
            }),
    ]
}

/// What a parse of `body` may answer: a typed refusal on one line, or
/// frames inside the body, in order, that written out again parse the same.
fn check(body: &[u8], allow_absent: bool) -> Result<(), TestCaseError> {
    let parsed = if allow_absent {
        parse_fetched(body)
    } else {
        parse_batch(body).map(|objects| {
            objects
                .into_iter()
                .map(|o| FetchedObject {
                    object: o.object,
                    data: Some(o.data),
                })
                .collect()
        })
    };
    let frames = match parsed {
        Ok(frames) => frames,
        Err(error) => {
            let message = error.to_string();
            prop_assert!(!message.contains('\n'), "{:?}", message);
            if let BatchFormatError::MalformedHeader { header, .. } = &error {
                prop_assert!(header.len() <= 4 * 96, "{} bytes", header.len());
            }
            return Ok(());
        }
    };
    prop_assert!(frames.len() <= BATCH_OBJECTS_MAX);
    let mut end = 0;
    let mut rewritten = Vec::new();
    for frame in &frames {
        match &frame.data {
            Some(range) => {
                prop_assert!(range.start >= end && range.end <= body.len());
                end = range.end;
                rewritten.extend_from_slice(batch_header(&frame.object, range.len()).as_bytes());
                rewritten.extend_from_slice(&body[range.clone()]);
            }
            None => {
                prop_assert!(allow_absent, "a batch held an absent object");
                rewritten.extend_from_slice(absent_header(&frame.object).as_bytes());
            }
        }
    }
    let again = parse_fetched(&rewritten).expect("what parsed, rewritten, parses");
    prop_assert_eq!(again.len(), frames.len());
    for (a, b) in again.iter().zip(&frames) {
        prop_assert_eq!(a.object, b.object);
        prop_assert_eq!(
            a.data.as_ref().map(|r| &rewritten[r.clone()]),
            b.data.as_ref().map(|r| &body[r.clone()])
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(1024))]

    #[test]
    fn batch_parser_survives_hostile_bodies(body in hostile_body()) {
        check(&body, false)?;
    }

    #[test]
    fn fetch_parser_survives_hostile_answers(body in hostile_body()) {
        check(&body, true)?;
    }

    #[test]
    fn valid_bodies_parse_to_what_was_written(
        objects in prop::collection::vec(object(), 0..40),
        absent in any::<bool>(),
    ) {
        let body = valid_body(&objects, absent);
        let parsed = parse_fetched(&body).expect("a valid body parses");
        prop_assert_eq!(parsed.len(), objects.len());
        for (frame, (object, data)) in parsed.iter().zip(&objects) {
            prop_assert_eq!(frame.object, *object);
            let expected = match data {
                None if !absent => Some(&[][..]),
                data => data.as_deref(),
            };
            prop_assert_eq!(frame.data.as_ref().map(|r| &body[r.clone()]), expected);
        }
        let batch = parse_batch(&body);
        prop_assert_eq!(batch.is_ok(), !absent || objects.iter().all(|(_, d)| d.is_some()));
    }
}
