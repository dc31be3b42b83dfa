//! Memory of an org's pack index at scale (BENCHMARKS.md "Packs"): writes
//! synthetic pack indexes straight into a local store, then loads them as
//! the store does (a merged file, [`store::midx`]) or as it did before (a
//! hash map of every object), looks objects up, and prints the process's
//! peak and current RSS.
//!
//! ```text
//! cargo run --release -p store --example index_rss -- gen STORE_DIR OBJECTS
//! cargo run --release -p store --example index_rss -- map STORE_DIR
//! cargo run --release -p store --example index_rss -- merged STORE_DIR CACHE_DIR
//! ```
//!
//! Run `merged` twice: the first builds the merged file from the pack
//! indexes, the second (a new process) opens it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use store::backend::Backend;
use store::pack::{Entry, PackId, PackIndex};
use store::store::{KeyKind, ObjectId, PackPart, parse_key};
use store::{Digest, OrgId, Store};

/// Objects per pack index: a full pack's worth.
const PER_PACK: u64 = 16 * 1024;
const LENGTH: u32 = 100;
const LOOKUPS: u64 = 100_000;

fn object(i: u64) -> ObjectId {
    ObjectId::block(Digest::of(&i.to_le_bytes()))
}

fn org() -> OrgId {
    "bench".parse().expect("org")
}

/// VmHWM and VmRSS of this process, in MiB.
fn rss() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").expect("proc status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse::<f64>().ok())
            .map_or(0.0, |kib| kib / 1024.0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

fn report(what: &str, objects: u64, started: Instant) {
    let (peak, now) = rss();
    println!(
        "{what}: {objects} objects; peak RSS {peak:.1} MiB, RSS after {now:.1} MiB; {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

fn listed(backend: &dyn Backend) -> Vec<PackId> {
    backend
        .list(&Store::packs_prefix(&org()))
        .expect("list")
        .iter()
        .filter_map(|meta| match parse_key(&meta.key) {
            Some(KeyKind::Pack {
                pack,
                part: PackPart::Index,
                ..
            }) => Some(pack),
            _ => None,
        })
        .collect()
}

fn generate(backend: &dyn Backend, objects: u64) {
    let mut next = 0u64;
    let mut pack_number = 0u64;
    while next < objects {
        let count = PER_PACK.min(objects - next);
        let mut id = [0u8; 16];
        id.copy_from_slice(&Digest::of(&pack_number.to_le_bytes()).0[..16]);
        let entries = (0..count)
            .map(|j| Entry {
                object: object(next + j),
                offset: store::pack::PACK_HEADER_BYTES + j * u64::from(LENGTH),
                length: LENGTH,
            })
            .collect();
        let index = PackIndex {
            pack: PackId(id),
            pack_bytes: store::pack::PACK_HEADER_BYTES + count * u64::from(LENGTH),
            born: None,
            entries,
        };
        let key = Store::pack_key(&org(), &index.pack, PackPart::Index);
        backend
            .put(&key, &store::pack::encode_index(&org(), &index))
            .expect("put");
        next += count;
        pack_number += 1;
    }
    println!("wrote {objects} objects' entries in {pack_number} pack indexes");
}

/// The index as it was before the merged file: every object in a map.
fn map(backend: &dyn Backend) {
    struct Located {
        slot: u32,
        offset: u64,
        length: u32,
    }
    let started = Instant::now();
    let mut slots = Vec::new();
    let mut by_pack = HashMap::new();
    let mut objects: HashMap<ObjectId, Located> = HashMap::new();
    for pack in listed(backend) {
        let bytes = backend
            .get(&Store::pack_key(&org(), &pack, PackPart::Index))
            .expect("get")
            .expect("listed");
        let index = store::pack::decode_index(&org(), &pack, &bytes).expect("index");
        slots.push(pack);
        by_pack.insert(pack, slots.len() as u32 - 1);
        objects.reserve(index.entries.len());
        for entry in &index.entries {
            objects.insert(
                entry.object,
                Located {
                    slot: slots.len() as u32 - 1,
                    offset: entry.offset,
                    length: entry.length,
                },
            );
        }
    }
    let total = objects.len() as u64;
    let found = (0..LOOKUPS)
        .filter(|i| {
            objects.get(&object(i * 7919 % total)).is_some_and(|at| {
                (at.slot as usize) < slots.len() && at.offset > 0 && at.length == LENGTH
            })
        })
        .count();
    assert_eq!(found as u64, LOOKUPS);
    report("hash map (before)", total, started);
}

fn merged(backend: Arc<dyn Backend>, cache: &str) {
    let started = Instant::now();
    let store = Store::new(backend).with_index_cache(cache.into());
    let first = store.locate(&org(), &object(0)).expect("locate");
    assert!(first.is_some());
    let stats = store.index_stats(&org());
    let total = stats.merged_entries + stats.overlay_objects as u64;
    let opened = started.elapsed();
    let lookups = Instant::now();
    for i in 0..LOOKUPS {
        let at = store
            .locate(&org(), &object(i * 7919 % total))
            .expect("locate");
        assert!(at.is_some());
    }
    println!(
        "open or build {:.2} s, {LOOKUPS} lookups {:.2} s; {stats:?}",
        opened.as_secs_f64(),
        lookups.elapsed().as_secs_f64()
    );
    report("merged file (now)", total, started);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["gen", dir, objects] => {
            let backend = store::backend::open(dir).expect("store");
            generate(backend.as_ref(), objects.parse().expect("object count"));
        }
        ["map", dir] => map(store::backend::open(dir).expect("store").as_ref()),
        ["merged", dir, cache] => merged(store::backend::open(dir).expect("store"), cache),
        _ => {
            eprintln!("usage: index_rss gen DIR OBJECTS | map DIR | merged DIR CACHE_DIR");
            std::process::exit(2);
        }
    }
}
