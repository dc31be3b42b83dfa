//! The conformance suite every `Backend` passes: the local directory, the
//! in-memory test backend and S3. The S3 run needs the S3-compatible server
//! that `scripts/test.sh` starts (`ROOST_TEST_S3_BUCKET` and the `AWS_*`
//! variables); without it the S3 tests fail rather than pass vacuously.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use store::Error;
use store::backend::{self, Backend, LocalBackend, MemoryBackend};

use crate::support::tempdir;

/// How far a backend's clock may be from ours (S3 timestamps have whole
/// seconds, and the server's clock is not ours).
const CLOCK_SKEW_MAX: Duration = Duration::from_secs(120);

/// Every behaviour the engine relies on from a backend. Keys are chosen
/// like the ones `Store` builds; the backend must be empty.
pub fn conformance(backend: &dyn Backend) {
    round_trip(backend);
    absent_is_none_not_error(backend);
    exists_answers_each_key_in_order(backend);
    head_reports_size_and_a_recent_time(backend);
    list_returns_exactly_the_keys_under_the_prefix(backend);
    delete_removes_and_tolerates_absent(backend);
    put_durable_replaces(backend);
    second_put_of_a_key_is_fine(backend);
    put_batch_stores_every_object(backend);
    ranged_reads_return_what_is_there(backend);
    any_under_answers_whether_a_prefix_holds_anything(backend);
    backend.sync().expect("sync");
}

fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn round_trip(backend: &dyn Backend) {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("rt/empty", Vec::new()),
        ("rt/text", b"hello, store".to_vec()),
        ("rt/all-bytes", (0..=255u8).collect()),
        ("rt/deep/er/still/deeper/obj", b"nested".to_vec()),
        ("rt/ab/abcdef0123", pseudo_random(1 << 20, 7)),
    ];
    for (key, data) in &cases {
        backend.put(key, data).expect("put");
    }
    for (key, data) in &cases {
        let got = backend.get(key).expect("get");
        assert_eq!(got.as_ref(), Some(data), "round trip of {key}");
    }
    // A batch read answers in the order asked, absent keys as `None`.
    let mut keys: Vec<String> = cases.iter().rev().map(|(key, _)| key.to_string()).collect();
    keys.insert(2, "rt/never-stored".to_owned());
    let got = backend.get_batch(&keys).expect("get_batch");
    let mut expected: Vec<Option<Vec<u8>>> =
        cases.iter().rev().map(|(_, d)| Some(d.clone())).collect();
    expected.insert(2, None);
    assert_eq!(got, expected, "get_batch");
    assert_eq!(
        backend.get_batch(&[]).expect("empty batch"),
        Vec::<Option<Vec<u8>>>::new()
    );
}

fn absent_is_none_not_error(backend: &dyn Backend) {
    backend.put("absent/here", b"x").expect("put");
    for key in ["absent/missing", "absent/no/such/dir/key", "never/was/here"] {
        assert_eq!(backend.get(key).expect("get of absent key"), None, "{key}");
        assert_eq!(
            backend.head(key).expect("head of absent key"),
            None,
            "{key}"
        );
    }
}

fn exists_answers_each_key_in_order(backend: &dyn Backend) {
    assert_eq!(
        backend.exists(&[]).expect("empty batch"),
        Vec::<bool>::new()
    );
    // More keys than the S3 backend sends concurrently, present and absent
    // interleaved irregularly, so an answer out of order shows.
    let keys: Vec<String> = (0..75).map(|i| format!("ex/{:02}/k{i}", i % 7)).collect();
    let expected: Vec<bool> = (0..75).map(|i| i % 3 == 0 || i % 5 == 0).collect();
    for (key, present) in keys.iter().zip(&expected) {
        if *present {
            backend.put(key, key.as_bytes()).expect("put");
        }
    }
    assert_eq!(backend.exists(&keys).expect("exists"), expected);
}

fn head_reports_size_and_a_recent_time(backend: &dyn Backend) {
    let before = SystemTime::now();
    backend.put("head/obj", &[5u8; 1234]).expect("put");
    let meta = backend.head("head/obj").expect("head").expect("present");
    assert_eq!(meta.key, "head/obj");
    assert_eq!(meta.size, 1234);
    assert_recent(meta.last_modified, before);
}

fn assert_recent(time: SystemTime, before: SystemTime) {
    let now = SystemTime::now();
    assert!(
        time + CLOCK_SKEW_MAX >= before && time <= now + CLOCK_SKEW_MAX,
        "last_modified {time:?} is not between {before:?} and {now:?}"
    );
}

fn list_returns_exactly_the_keys_under_the_prefix(backend: &dyn Backend) {
    let before = SystemTime::now();
    let objects: &[(&str, &[u8])] = &[
        ("ls/orgs/a/blocks/ab/ab01", b"one"),
        ("ls/orgs/a/trees/cd/cd02", b"three"),
        ("ls/orgs/a/homes/h", b""),
        // Siblings sharing the name's first letters must not leak in.
        ("ls/orgs/a2/blocks/ab/ab01", b"sibling"),
        ("ls/orgs/ab", b"file-next-to-dir"),
        ("ls/orgs/b/homes/h", b"other"),
    ];
    for (key, data) in objects {
        backend.put(key, data).expect("put");
    }
    let listed = |prefix: &str| -> BTreeMap<String, u64> {
        backend
            .list(prefix)
            .expect("list")
            .into_iter()
            .map(|meta| {
                assert_recent(meta.last_modified, before);
                (meta.key, meta.size)
            })
            .collect()
    };
    let expected = |keys: &[&str]| -> BTreeMap<String, u64> {
        objects
            .iter()
            .filter(|(key, _)| keys.contains(key))
            .map(|(key, data)| (key.to_string(), data.len() as u64))
            .collect()
    };
    assert_eq!(
        listed("ls/orgs/a/"),
        expected(&[
            "ls/orgs/a/blocks/ab/ab01",
            "ls/orgs/a/trees/cd/cd02",
            "ls/orgs/a/homes/h"
        ])
    );
    assert_eq!(
        listed("ls/orgs/a/blocks/"),
        expected(&["ls/orgs/a/blocks/ab/ab01"])
    );
    assert_eq!(
        listed("ls/orgs/"),
        expected(&objects.iter().map(|(key, _)| *key).collect::<Vec<_>>())
    );
    for empty in ["ls/orgs/c/", "ls/orgs/a/blocks/zz/", "nothing/at/all/"] {
        assert_eq!(listed(empty), BTreeMap::new(), "list({empty:?})");
    }
}

fn delete_removes_and_tolerates_absent(backend: &dyn Backend) {
    backend.put("del/keep", b"k").expect("put");
    backend.put("del/gone", b"g").expect("put");
    backend.delete("del/gone").expect("delete");
    assert_eq!(backend.get("del/gone").expect("get"), None);
    assert_eq!(backend.head("del/gone").expect("head"), None);
    let keys = ["del/gone".to_owned(), "del/keep".to_owned()];
    assert_eq!(backend.exists(&keys).expect("exists"), vec![false, true]);
    let listed: Vec<String> = backend
        .list("del/")
        .expect("list")
        .into_iter()
        .map(|meta| meta.key)
        .collect();
    assert_eq!(listed, vec!["del/keep".to_owned()]);
    backend
        .delete("del/gone")
        .expect("second delete of the same key");
    backend
        .delete("del/never/existed")
        .expect("delete of an absent key");
}

fn put_durable_replaces(backend: &dyn Backend) {
    backend.put_durable("dur/homes/h", b"first").expect("put");
    assert_eq!(
        backend.get("dur/homes/h").expect("get").as_deref(),
        Some(&b"first"[..])
    );
    backend.put_durable("dur/homes/h", b"2nd").expect("replace");
    assert_eq!(
        backend.get("dur/homes/h").expect("get").as_deref(),
        Some(&b"2nd"[..])
    );
    let meta = backend.head("dur/homes/h").expect("head").expect("present");
    assert_eq!(meta.size, 3);
    // A pointer also replaces an object written with a plain put.
    backend.put("dur/homes/p", b"plain").expect("put");
    backend.put_durable("dur/homes/p", b"durable").expect("put");
    assert_eq!(
        backend.get("dur/homes/p").expect("get").as_deref(),
        Some(&b"durable"[..])
    );
}

fn second_put_of_a_key_is_fine(backend: &dyn Backend) {
    let data = pseudo_random(5000, 3);
    backend.put("twice/ab/ab99", &data).expect("first put");
    backend.put("twice/ab/ab99", &data).expect("second put");
    assert_eq!(backend.get("twice/ab/ab99").expect("get"), Some(data));
    assert_eq!(backend.list("twice/").expect("list").len(), 1);
}

fn put_batch_stores_every_object(backend: &dyn Backend) {
    backend.put_batch(&[]).expect("empty batch");
    let objects: Vec<(String, Vec<u8>)> = (0..20)
        .map(|i| {
            (
                format!("batch/{:02}/o{i}", i % 3),
                pseudo_random(i * 97, i as u64),
            )
        })
        .collect();
    // A key twice in one batch: the same content, as content addressing
    // gives.
    let mut batch: Vec<(String, &[u8])> = objects
        .iter()
        .map(|(key, data)| (key.clone(), data.as_slice()))
        .collect();
    batch.push(batch[4].clone());
    backend.put_batch(&batch).expect("put_batch");
    for (key, data) in &objects {
        assert_eq!(backend.get(key).expect("get").as_ref(), Some(data), "{key}");
    }
    assert_eq!(backend.list("batch/").expect("list").len(), objects.len());
}

/// Packs are read in ranges: the bytes asked for, fewer where the object
/// ends sooner (a truncated pack), nothing past its end, `None` when it is
/// absent; several ranges in one call answer in order.
fn ranged_reads_return_what_is_there(backend: &dyn Backend) {
    let data = pseudo_random(100_000, 7);
    backend.put("range/pack", &data).expect("put");
    let read = |offset: u64, len: u64| {
        backend
            .get_range("range/pack", offset, len)
            .expect("get_range")
            .expect("present")
    };
    assert_eq!(read(0, 10), data[..10]);
    assert_eq!(read(54_321, 1000), data[54_321..55_321]);
    assert_eq!(read(99_990, 100), data[99_990..], "cut at the end");
    assert_eq!(read(100_000, 10), Vec::<u8>::new(), "past the end");
    assert_eq!(
        backend.get_range("range/absent", 0, 10).expect("get_range"),
        None
    );
    let many = backend
        .get_ranges(&[
            ("range/pack".to_owned(), 5, 5),
            ("range/absent".to_owned(), 0, 1),
            ("range/pack".to_owned(), 90_000, 10_000),
        ])
        .expect("get_ranges");
    assert_eq!(
        many,
        vec![
            Some(data[5..10].to_vec()),
            None,
            Some(data[90_000..].to_vec())
        ]
    );
    // Streamed: the pieces together are the range, whatever their sizes.
    let streamed = |key: &str, offset: u64, len: u64| {
        let mut got = Vec::new();
        let found = backend
            .get_range_each(key, offset, len, &mut |piece| {
                got.extend_from_slice(piece);
                Ok(())
            })
            .expect("get_range_each");
        found.then_some(got)
    };
    assert_eq!(streamed("range/pack", 0, 100_000), Some(data.clone()));
    assert_eq!(
        streamed("range/pack", 54_321, 1000),
        Some(data[54_321..55_321].to_vec())
    );
    assert_eq!(
        streamed("range/pack", 99_990, 100),
        Some(data[99_990..].to_vec())
    );
    assert_eq!(streamed("range/pack", 100_000, 10), Some(Vec::new()));
    assert_eq!(streamed("range/absent", 0, 10), None);
    // A refusal from the reader ends the read with it.
    let refused = backend.get_range_each("range/pack", 0, 100_000, &mut |_| {
        Err(Error::Backend {
            op: "test",
            key: "range/pack".to_owned(),
            message: "refused".to_owned(),
        })
    });
    assert!(
        matches!(&refused, Err(Error::Backend { op: "test", .. })),
        "{refused:?}"
    );
}

fn any_under_answers_whether_a_prefix_holds_anything(backend: &dyn Backend) {
    assert!(!backend.any_under("nothing-here/").expect("any_under"));
    backend.put("some/deep/er/key", b"x").expect("put");
    assert!(backend.any_under("some/").expect("any_under"));
    assert!(backend.any_under("some/deep/").expect("any_under"));
    assert!(!backend.any_under("some/other/").expect("any_under"));
}

#[test]
fn local_backend_conforms() {
    let dir = tempdir();
    let backend = LocalBackend::open(dir.path().join("store")).expect("open");
    conformance(&backend);
}

#[test]
fn memory_backend_conforms() {
    conformance(&MemoryBackend::default());
}

#[test]
fn backends_opened_by_url_conform() {
    let dir = tempdir();
    let path = dir.path().join("by-path");
    let file_url = format!("file://{}", dir.path().join("by-file-url").display());
    for url in [
        path.to_str().expect("utf-8 temp path"),
        &file_url,
        "memory:",
    ] {
        let backend = backend::open(url).expect("open");
        conformance(backend.as_ref());
    }
}

#[test]
fn s3_backend_conforms() {
    let backend = s3_backend("conformance");
    conformance(backend.as_ref());
}

/// Invalid store URLs are refused with a reason, not opened as paths.
#[test]
fn invalid_store_urls_are_refused() {
    for url in [
        "",
        "s3://",
        "s3:///prefix",
        "http://example.com/x",
        "gs://b/p",
    ] {
        match backend::open(url) {
            Err(Error::InvalidUrl { .. }) => {}
            Err(other) => panic!("{url:?}: expected InvalidUrl, got {other}"),
            Ok(_) => panic!("{url:?}: opened"),
        }
    }
}

/// A put killed half way leaves a temp file; it is never listed as an object.
#[test]
fn local_backend_does_not_list_leftover_temp_files() {
    let dir = tempdir();
    let backend = LocalBackend::open(dir.path()).expect("open");
    backend.put("orgs/a/blocks/ab/ab01", b"x").expect("put");
    std::fs::write(dir.path().join("orgs/a/blocks/ab/.tmp.999.0"), b"half").expect("write");
    let keys: Vec<String> = backend
        .list("orgs/")
        .expect("list")
        .into_iter()
        .map(|meta| meta.key)
        .collect();
    assert_eq!(keys, vec!["orgs/a/blocks/ab/ab01".to_owned()]);
}

/// A listing while keys come and go (store locks, a gc deleting) lists a
/// snapshot; a key removed between readdir and stat is not an error. This
/// race once failed a gc with "not found: …/locks/commit/…".
#[test]
fn local_backend_lists_while_keys_vanish() {
    let dir = tempdir();
    let backend = Arc::new(LocalBackend::open(dir.path()).expect("open"));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (backend, stop) = (Arc::clone(&backend), Arc::clone(&stop));
        std::thread::spawn(move || {
            // About 200 keys live at any time, each deleted soon after.
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                backend.put(&format!("locks/commit/{n}"), b"").expect("put");
                if n >= 200 {
                    let old = format!("locks/commit/{}", n - 200);
                    backend.delete(&old).expect("delete");
                }
                n += 1;
            }
        })
    };
    for _ in 0..2000 {
        backend.list("locks/").expect("a listing during churn");
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().expect("churn thread");
}

/// A key that would resolve outside the store directory is an error, never
/// a read or write of some other file (nor a silent "absent").
#[test]
fn local_backend_refuses_keys_escaping_its_root() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let backend = LocalBackend::open(&root).expect("open");
    std::fs::write(dir.path().join("secret"), b"outside").expect("write");
    for key in [
        "../secret",
        "a/../../secret",
        "/etc/passwd",
        "a//b",
        "./x",
        "",
    ] {
        assert!(backend.get(key).is_err(), "get {key:?}");
        assert!(backend.put(key, b"x").is_err(), "put {key:?}");
        assert!(backend.delete(key).is_err(), "delete {key:?}");
    }
    assert_eq!(
        std::fs::read(dir.path().join("secret")).expect("read"),
        b"outside"
    );
}

/// The S3 bucket the suite's server provides, failing loudly without it.
pub fn s3_bucket() -> String {
    std::env::var("ROOST_TEST_S3_BUCKET").unwrap_or_else(|_| {
        panic!(
            "ROOST_TEST_S3_BUCKET is unset: the S3 backend tests need the \
             S3-compatible server scripts/test.sh starts; run scripts/test.sh"
        )
    })
}

/// An S3 backend under a prefix no other test (or earlier run) uses.
pub fn s3_backend(test: &str) -> Arc<dyn Backend> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let bucket = s3_bucket();
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let prefix = format!("it/{test}-{}-{nanos}-{n}", std::process::id());
    backend::open(&format!("s3://{bucket}/{prefix}")).expect("open the S3 test bucket")
}
