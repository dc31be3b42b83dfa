//! Hostile trees and damaged stores: refused, with nothing written outside
//! the destination and no damaged file left behind.

use std::fs;

use store::store::ObjectId;
use store::tree::{Entry, EntryKind, Tree};
use store::{Digest, HomeName, OrgId, Store};

use crate::harness::{Backend, Env, bytes, write};

fn org() -> OrgId {
    "acme".parse().expect("valid")
}

/// Writes a crafted tree (valid or not) with `file content` blocks and
/// points home `h` at it.
fn plant(store: &Store, entries: Vec<Entry>, blobs: &[&[u8]]) {
    for blob in blobs {
        store
            .put_object(&org(), &ObjectId::block(Digest::of(blob)), blob)
            .expect("put block");
    }
    let bytes = Tree { entries }.encode_unchecked();
    let root = Digest::of(&bytes);
    store
        .put_object(&org(), &ObjectId::tree(root), &bytes)
        .expect("put tree");
    let home: HomeName = "h".parse().expect("valid");
    store.write_home(&org(), &home, &root).expect("pointer");
}

fn file(name: &[u8], content: &[u8]) -> Entry {
    Entry {
        name: name.to_vec(),
        mode: 0o644,
        size: content.len() as u64,
        mtime_ns: 0,
        kind: EntryKind::File {
            blocks: vec![Digest::of(content)],
        },
    }
}

fn dir(name: &[u8], tree: Digest) -> Entry {
    Entry {
        name: name.to_vec(),
        mode: 0o755,
        size: 0,
        mtime_ns: 0,
        kind: EntryKind::Dir { tree },
    }
}

fn symlink(name: &[u8], target: &[u8]) -> Entry {
    Entry {
        name: name.to_vec(),
        mode: 0o777,
        size: target.len() as u64,
        mtime_ns: 0,
        kind: EntryKind::Symlink {
            target: target.to_vec(),
        },
    }
}

fn subtree(store: &Store, entries: Vec<Entry>) -> Digest {
    let bytes = Tree { entries }.encode_unchecked();
    let digest = Digest::of(&bytes);
    store
        .put_object(&org(), &ObjectId::tree(digest), &bytes)
        .expect("put tree");
    digest
}

/// Everything under `root` except `dest`, to prove nothing was written.
fn snapshot_outside(root: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).expect("read_dir") {
            let path = entry.expect("entry").path();
            if path.ends_with("dest") || path.ends_with("state") {
                continue;
            }
            out.push(path.display().to_string());
            if path.is_dir() && !path.is_symlink() {
                stack.push(path);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn crafted_malicious_trees_are_refused_and_write_nothing_outside() {
    type MakeEntries = Box<dyn Fn(&Store) -> Vec<Entry>>;
    let cases: Vec<(&str, MakeEntries)> = vec![
        ("dot-dot", Box::new(|_: &Store| vec![file(b"..", b"pwned")])),
        (
            "absolute",
            Box::new(|_: &Store| vec![file(b"/tmp/roost-pwned", b"pwned")]),
        ),
        (
            "slash inside",
            Box::new(|_: &Store| vec![file(b"a/../../escape", b"pwned")]),
        ),
        (
            "empty name",
            Box::new(|_: &Store| vec![file(b"", b"pwned")]),
        ),
        (
            "symlink then a file through it",
            Box::new(|store: &Store| {
                let inner = subtree(store, vec![file(b"escape", b"pwned")]);
                vec![symlink(b"a", b"../outside"), dir(b"a", inner)]
            }),
        ),
        (
            "dot-dot directory",
            Box::new(|store: &Store| {
                let inner = subtree(store, vec![file(b"escape", b"pwned")]);
                vec![dir(b"..", inner)]
            }),
        ),
    ];
    for (label, entries) in cases {
        let env = Env::new(Backend::Local);
        fs::create_dir_all(env.path("outside")).expect("mkdir");
        let store = Store::open(&env.store).expect("open");
        plant(&store, entries(&store), &[b"pwned"]);
        let before = snapshot_outside(env.tmp.path());
        let err = env.pull_fails(&env.path("dest"), "acme", "h");
        assert!(err.contains("malformed tree"), "{label}: {err}");
        assert_eq!(
            snapshot_outside(env.tmp.path()),
            before,
            "{label}: something was written outside dest"
        );
        assert!(!std::path::Path::new("/tmp/roost-pwned").exists());
    }
}

#[test]
fn existing_symlinks_in_the_destination_are_replaced_not_followed() {
    let env = Env::new(Backend::Local);
    let outside = env.path("outside");
    fs::create_dir_all(&outside).expect("mkdir");
    write(&outside.join("victim"), b"original");
    let store = Store::open(&env.store).expect("open");
    let inner = subtree(&store, vec![file(b"victim", b"pwned")]);
    plant(
        &store,
        vec![dir(b"a", inner), file(b"b", b"pwned")],
        &[b"pwned"],
    );
    let dest = env.path("dest");
    fs::create_dir_all(&dest).expect("mkdir");
    // The old copy holds symlinks where the snapshot has a dir and a file.
    std::os::unix::fs::symlink(&outside, dest.join("a")).expect("symlink");
    std::os::unix::fs::symlink(outside.join("victim"), dest.join("b")).expect("symlink");
    env.pull(&dest, "acme", "h");
    assert_eq!(fs::read(outside.join("victim")).expect("read"), b"original");
    assert!(!dest.join("a").is_symlink() && dest.join("a").is_dir());
    assert_eq!(fs::read(dest.join("a/victim")).expect("read"), b"pwned");
    assert!(!dest.join("b").is_symlink());
}

#[test]
fn hard_linked_files_in_the_destination_are_broken_not_written_through() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    write(&src.join("f"), b"from the snapshot");
    env.push(&src, "acme", "h");
    let dest = env.path("dest");
    fs::create_dir_all(&dest).expect("mkdir");
    write(&env.path("outside-link"), b"do not touch");
    fs::hard_link(env.path("outside-link"), dest.join("f")).expect("link");
    env.pull(&dest, "acme", "h");
    assert_eq!(
        fs::read(env.path("outside-link")).expect("read"),
        b"do not touch"
    );
    assert_eq!(
        fs::read(dest.join("f")).expect("read"),
        b"from the snapshot"
    );
}

#[test]
fn corrupted_block_is_detected_and_never_becomes_a_file() {
    for backend in [Backend::Local, Backend::S3] {
        let env = Env::new(backend);
        let src = env.path("src");
        let content = bytes(11, 100_000);
        write(&src.join("dir/precious.bin"), &content);
        env.push(&src, "acme", "h");
        let store = Store::open(&env.store).expect("open");
        // The block's last stored byte, in the pack that holds it.
        let object = ObjectId::block(Digest::of(&content));
        let at = store
            .locate(&org(), &object)
            .expect("locate")
            .expect("packed");
        let key = Store::pack_key(&org(), &at.pack, store::store::PackPart::Data);
        let mut stored = store.backend().get(&key).expect("get").expect("present");
        let last = (at.offset + u64::from(at.length) - 1) as usize;
        stored[last] ^= 0xff;
        store.backend().put(&key, &stored).expect("put");
        // Into an existing directory: it stays (pull makes it match the
        // home, never removes it), the corrupt block becomes no file and
        // leaves no temporary one.
        let dest = env.path("dest");
        fs::create_dir_all(&dest).expect("mkdir");
        let err = env.pull_fails(&dest, "acme", "h");
        assert!(
            err.contains("hash mismatch") && err.contains("dir/precious.bin"),
            "{backend:?}: {err}"
        );
        assert!(
            !dest.join("dir/precious.bin").exists(),
            "{backend:?}: a corrupt block became a file"
        );
        let leftovers: Vec<_> = fs::read_dir(dest.join("dir")).expect("read_dir").collect();
        assert!(
            leftovers.is_empty(),
            "{backend:?}: temporary files left: {leftovers:?}"
        );
        // Into a new directory (issue 13, point 7): nothing is left behind,
        // not a partial tree that would pass for the home.
        let fresh = env.path("fresh");
        env.pull_fails(&fresh, "acme", "h");
        assert!(
            !fresh.exists(),
            "{backend:?}: a failed pull left a partial tree at {}",
            fresh.display()
        );
        let verify = env.roost(&["store", "verify", "--store", &env.store, "--json"]);
        assert!(!verify.status.success());
        let report: serde_json::Value = serde_json::from_slice(&verify.stdout).expect("json");
        assert_eq!(report["ok"], false);
        assert!(
            report["errors"][0]
                .as_str()
                .expect("error")
                .contains("dir/precious.bin"),
            "{report}"
        );
    }
}
