//! Shared test helpers: names, homes written from a description, directory
//! snapshots to compare after a round trip, store-wide invariant checks and
//! `Double`, a backend wrapper that records calls and injects faults.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use store::backend::{Backend, ObjectMeta};
use store::excludes::Excludes;
use store::progress::NoProgress;
use store::pull::{PullOptions, PullReport};
use store::push::{PushOptions, PushReport};
use store::store::{KeyKind, ObjectId, ObjectKind, PackPart, parse_key};
use store::tree::EntryKind;
use store::{Digest, Error, HomeName, OrgId, Result, Store};

pub const STORE_ID: &str = "test-store";

pub fn org(name: &str) -> OrgId {
    name.parse().expect("valid org name")
}

pub fn home(name: &str) -> HomeName {
    name.parse().expect("valid home name")
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("create a temp dir")
}

/// Push options that save everything (no default excludes), no index.
pub fn push_options() -> PushOptions {
    let mut options = PushOptions::new(STORE_ID);
    options.excludes = Excludes::none();
    options
}

pub fn pull_options() -> PullOptions {
    PullOptions {
        cache: None,
        fill_cache: true,
        index_path: None,
        store_id: STORE_ID.to_owned(),
        index_dev: None,
        check_room: false,
        room_also: None,
    }
}

/// Pushes on two uploading threads ([`on_two_threads`]).
pub fn push(store: &Store, org: &OrgId, home: &HomeName, dir: &Path) -> Result<PushReport> {
    on_two_threads(|| store::push::push(store, org, home, dir, &push_options(), &NoProgress))
}

/// Runs `work` (a push) in a pool of two threads of its own, whatever the
/// machine: how a push shares blocks out into packs depends on how many
/// threads upload, and the tests' expectations of packs (how many, which
/// holds what) are those of two.
pub fn on_two_threads<T: Send>(work: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("thread pool")
        .install(work)
}

pub fn pull(store: &Store, org: &OrgId, home: &HomeName, dest: &Path) -> Result<PullReport> {
    store::pull::pull(store, org, home, dest, &pull_options(), &NoProgress)
}

/// Writes `files` (path → content) under `dir`, creating parent directories.
pub fn write_files(dir: &Path, files: &[(&str, &[u8])]) {
    for (path, content) in files {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("create parent dirs");
        }
        fs::write(&path, content).expect("write file");
    }
}

/// A new temp dir holding `files`.
pub fn home_dir(files: &[(&str, &[u8])]) -> tempfile::TempDir {
    let dir = tempdir();
    write_files(dir.path(), files);
    dir
}

/// A file system entry to create, for generated homes.
#[derive(Clone, Debug)]
pub enum Node {
    File {
        content: Vec<u8>,
        mode: u32,
        mtime_ns: i64,
    },
    Dir {
        entries: BTreeMap<Vec<u8>, Node>,
        mode: u32,
        mtime_ns: i64,
    },
    Symlink {
        target: Vec<u8>,
        mtime_ns: i64,
    },
}

/// Creates `entries` inside the existing directory `dir`; children first,
/// then mode and mtime, so the recorded metadata is what stays.
pub fn write_nodes(dir: &Path, entries: &BTreeMap<Vec<u8>, Node>) {
    for (name, node) in entries {
        let path = dir.join(OsStr::from_bytes(name));
        match node {
            Node::File {
                content,
                mode,
                mtime_ns,
            } => {
                fs::write(&path, content).expect("write file");
                fs::set_permissions(&path, fs::Permissions::from_mode(*mode)).expect("chmod");
                set_mtime(&path, *mtime_ns);
            }
            Node::Dir {
                entries,
                mode,
                mtime_ns,
            } => {
                fs::create_dir(&path).expect("mkdir");
                write_nodes(&path, entries);
                fs::set_permissions(&path, fs::Permissions::from_mode(*mode)).expect("chmod");
                set_mtime(&path, *mtime_ns);
            }
            Node::Symlink { target, mtime_ns } => {
                std::os::unix::fs::symlink(OsStr::from_bytes(target), &path).expect("symlink");
                set_mtime(&path, *mtime_ns);
            }
        }
    }
}

/// Sets atime and mtime without following a symlink.
pub fn set_mtime(path: &Path, mtime_ns: i64) {
    let time = rustix::fs::Timespec {
        tv_sec: mtime_ns.div_euclid(1_000_000_000),
        tv_nsec: mtime_ns.rem_euclid(1_000_000_000) as _,
    };
    let times = rustix::fs::Timestamps {
        last_access: time,
        last_modification: time,
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &times,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .expect("set mtime");
}

/// What a directory holds, as pull must reproduce it: every entry below the
/// root with its type, permission bits, mtime and content or target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    Dir {
        mode: u32,
        mtime_ns: i64,
    },
    File {
        mode: u32,
        mtime_ns: i64,
        content: Vec<u8>,
    },
    Symlink {
        target: Vec<u8>,
        mtime_ns: i64,
    },
}

pub fn snapshot(root: &Path) -> BTreeMap<PathBuf, Seen> {
    fn walk(abs: &Path, rel: &Path, out: &mut BTreeMap<PathBuf, Seen>) {
        for entry in fs::read_dir(abs).expect("read dir") {
            let entry = entry.expect("dir entry");
            let abs = entry.path();
            let rel = rel.join(entry.file_name());
            let meta = fs::symlink_metadata(&abs).expect("lstat");
            let mtime_ns = meta.mtime() * 1_000_000_000 + meta.mtime_nsec();
            let mode = meta.mode() & 0o7777;
            let seen = if meta.is_dir() {
                walk(&abs, &rel, out);
                Seen::Dir { mode, mtime_ns }
            } else if meta.is_symlink() {
                let target = fs::read_link(&abs).expect("readlink");
                Seen::Symlink {
                    target: target.as_os_str().as_bytes().to_vec(),
                    mtime_ns,
                }
            } else {
                Seen::File {
                    mode,
                    mtime_ns,
                    content: fs::read(&abs).expect("read file"),
                }
            };
            out.insert(rel, seen);
        }
    }
    let mut out = BTreeMap::new();
    walk(root, Path::new(""), &mut out);
    out
}

/// What pull must make of a home pushed from `root`: its [`snapshot`]
/// without setuid and setgid bits, which trees never carry (issue 14).
pub fn as_pulled(root: &Path) -> BTreeMap<PathBuf, Seen> {
    let mut seen = snapshot(root);
    for entry in seen.values_mut() {
        if let Seen::Dir { mode, .. } | Seen::File { mode, .. } = entry {
            *mode &= !0o6000;
        }
    }
    seen
}

/// Paths and file contents, without modes and mtimes: for homes whose files
/// were rewritten (new mtimes) or written with the default umask.
pub fn contents(root: &Path) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
    snapshot(root)
        .into_iter()
        .map(|(path, seen)| match seen {
            Seen::File { content, .. } => (path, Some(content)),
            _ => (path, None),
        })
        .collect()
}

/// Every object reachable from `root` (the trees and the blocks).
pub fn reachable(store: &Store, org: &OrgId, root: Digest) -> HashSet<ObjectId> {
    let mut out = HashSet::new();
    let mut stack = vec![root];
    while let Some(digest) = stack.pop() {
        if !out.insert(ObjectId::tree(digest)) {
            continue;
        }
        let tree = store.get_tree(org, &digest).expect("reachable tree reads");
        for entry in tree.entries {
            match entry.kind {
                EntryKind::Dir { tree } => stack.push(tree),
                EntryKind::File { blocks } => out.extend(blocks.into_iter().map(ObjectId::block)),
                EntryKind::Symlink { .. } => {}
            }
        }
    }
    out
}

/// Every object present in the store, by the key it would have on its
/// own (`Store::object_key`): those under their own keys and those in a
/// pack whose index and bytes are both there.
pub fn object_keys(backend: &dyn Backend) -> HashSet<String> {
    let listed: Vec<String> = backend
        .list(Store::orgs_prefix())
        .expect("list the store")
        .into_iter()
        .map(|meta| meta.key)
        .collect();
    let all: HashSet<&str> = listed.iter().map(String::as_str).collect();
    let mut out = HashSet::new();
    for key in &listed {
        match parse_key(key) {
            Some(KeyKind::Object { .. }) => {
                out.insert(key.clone());
            }
            Some(KeyKind::Pack {
                org,
                pack,
                part: PackPart::Index,
            }) => {
                if !all.contains(Store::pack_key(&org, &pack, PackPart::Data).as_str()) {
                    continue;
                }
                let bytes = backend.get(key).expect("read an index").expect("listed");
                let index = store::pack::decode_index(&org, &pack, &bytes).expect("a sound index");
                out.extend(
                    index
                        .entries
                        .iter()
                        .map(|entry| Store::object_key(&org, &entry.object)),
                );
            }
            _ => {}
        }
    }
    out
}

/// The invariant the pruned missing-check relies on: every tree object in
/// the store has all its children (subtrees and blocks) in the store.
pub fn assert_present_trees_are_complete(store: &Store) {
    let keys = object_keys(store.backend().as_ref());
    for key in &keys {
        let Some(KeyKind::Object { org, object }) = parse_key(key) else {
            continue;
        };
        if object.kind != ObjectKind::Tree {
            continue;
        }
        let tree = store
            .get_tree(&org, &object.digest)
            .expect("a present tree reads");
        for entry in tree.entries {
            let children: Vec<ObjectId> = match entry.kind {
                EntryKind::Dir { tree } => vec![ObjectId::tree(tree)],
                EntryKind::File { blocks } => blocks.into_iter().map(ObjectId::block).collect(),
                EntryKind::Symlink { .. } => Vec::new(),
            };
            for child in children {
                let child_key = Store::object_key(&org, &child);
                assert!(
                    keys.contains(&child_key),
                    "tree {key} is present but its child {child_key} (entry {:?}) is not",
                    String::from_utf8_lossy(&entry.name)
                );
            }
        }
    }
}

/// Flips the last byte of an object's stored bytes, in its pack or under
/// its own key: the object no longer decodes to its name.
pub fn corrupt_stored(store: &Store, org: &OrgId, object: &ObjectId) {
    let (key, at) = match store.locate(org, object).expect("locate") {
        Some(at) => (
            Store::pack_key(org, &at.pack, PackPart::Data),
            (at.offset + u64::from(at.length) - 1) as usize,
        ),
        None => {
            let key = Store::object_key(org, object);
            let len = store
                .backend()
                .get(&key)
                .expect("get")
                .expect("stored")
                .len();
            (key, len - 1)
        }
    };
    let mut bytes = store.backend().get(&key).expect("get").expect("stored");
    bytes[at] ^= 0x55;
    store.backend().put(&key, &bytes).expect("corrupt");
}

pub fn assert_verify_ok(store: &Store) {
    let report = store::gc::verify(store).expect("verify runs");
    assert!(report.ok(), "verify found errors: {:#?}", report.errors);
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Faults a [`Double`] injects, counted from when they are armed.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Fail the n-th `list` call (1-based).
    pub fail_list_call: Option<u64>,
    /// Fail the n-th read (1-based) of this exact key: a `get` of it, or,
    /// for an object's own key, a ranged read of a pack that covers it.
    pub fail_get: Option<(String, u64)>,
    /// Let this many deletes succeed, then fail every later one.
    pub fail_delete_after: Option<u64>,
    /// Refuse a put of a tree whose children are neither stored nor
    /// earlier in the same batch, as the block service does.
    pub refuse_incomplete_trees: bool,
    /// Every `get` takes this long (a slow store: a long gc mark).
    pub get_delay: Option<Duration>,
    /// The n-th existence check (1-based: an `exists` call or a listing of
    /// an org's packs) answers this long after it looked: a slow answer
    /// that is stale by the time it arrives.
    pub delay_exists_call: Option<(u64, Duration)>,
}

#[derive(Default)]
struct Counters {
    lists: u64,
    pack_listings: u64,
    packs_written: Vec<usize>,
    ranged_reads: u64,
    gets: HashMap<String, u64>,
    single_gets: u64,
    deletes: u64,
    exists_batches: Vec<usize>,
    exists_calls: u64,
    get_batches: Vec<usize>,
    /// Requests that read: each `get`, each range, each key of a batch.
    read_requests: u64,
}

type Hook = Box<dyn FnOnce() + Send>;
type PieceHook = Box<dyn FnMut(u64, u64) + Send>;

/// A streamed ranged read arrives in pieces of this size, as a body does.
const RANGE_PIECE_BYTES: usize = 64 * 1024;

/// A backend wrapper that records calls and injects errors, in the manner
/// of neon's `UnreliableWrapper`.
pub struct Double {
    inner: Arc<dyn Backend>,
    faults: Mutex<Faults>,
    counters: Mutex<Counters>,
    /// Runs once, before the first delete; every delete waits for it.
    before_first_delete: Mutex<Option<Hook>>,
    /// Runs between the pieces of a streamed ranged read
    /// (`Backend::get_range_each`), with the bytes handed on so far and
    /// the read's length.
    between_range_pieces: Mutex<Option<PieceHook>>,
    /// Says it reads in batches, as the block service does.
    reads_in_batches: bool,
}

pub fn injected(op: &'static str, key: &str) -> Error {
    Error::Backend {
        op,
        key: key.to_owned(),
        message: "injected fault".to_owned(),
    }
}

impl Double {
    pub fn new(inner: Arc<dyn Backend>) -> Arc<Double> {
        Arc::new(Double::wrapping(inner, false))
    }

    /// A `Double` that reads in batches (`Backend::reads_in_batches`), so
    /// pull takes its batched path.
    pub fn batching(inner: Arc<dyn Backend>) -> Arc<Double> {
        Arc::new(Double::wrapping(inner, true))
    }

    fn wrapping(inner: Arc<dyn Backend>, reads_in_batches: bool) -> Double {
        Double {
            inner,
            faults: Mutex::new(Faults::default()),
            counters: Mutex::new(Counters::default()),
            before_first_delete: Mutex::new(None),
            between_range_pieces: Mutex::new(None),
            reads_in_batches,
        }
    }

    /// Sizes of the `get_batch` calls since the last `arm`.
    pub fn get_batches(&self) -> Vec<usize> {
        lock(&self.counters).get_batches.clone()
    }

    /// Single `get` calls since the last `arm` (a batch's are not counted).
    pub fn single_gets(&self) -> u64 {
        lock(&self.counters).single_gets
    }

    /// Installs `faults` and restarts every count from zero.
    pub fn arm(&self, faults: Faults) {
        *lock(&self.faults) = faults;
        *lock(&self.counters) = Counters::default();
    }

    pub fn before_first_delete(&self, hook: impl FnOnce() + Send + 'static) {
        *lock(&self.before_first_delete) = Some(Box::new(hook));
    }

    /// Runs `hook` between the pieces of every streamed ranged read, with
    /// the bytes handed on so far and the read's length.
    pub fn between_range_pieces(&self, hook: impl FnMut(u64, u64) + Send + 'static) {
        *lock(&self.between_range_pieces) = Some(Box::new(hook));
    }

    /// Sizes of the `exists` batches since the last `arm`.
    pub fn exists_batches(&self) -> Vec<usize> {
        lock(&self.counters).exists_batches.clone()
    }

    /// Objects in each pack written since the last `arm` (counted when
    /// its index is put).
    pub fn packs_written(&self) -> Vec<usize> {
        lock(&self.counters).packs_written.clone()
    }

    /// Existence checks since the last `arm`: `exists` calls and listings
    /// of an org's packs (how a store that writes packs answers one).
    pub fn existence_checks(&self) -> u64 {
        lock(&self.counters).exists_calls
    }

    /// Ranged reads (`get_range`, or one range of `get_ranges`) since the
    /// last `arm`.
    pub fn ranged_reads(&self) -> u64 {
        lock(&self.counters).ranged_reads
    }

    /// Requests that read since the last `arm`, as a store like S3 pays
    /// for them: each `get`, each ranged read, each key of a `get_batch`.
    pub fn read_requests(&self) -> u64 {
        lock(&self.counters).read_requests
    }

    /// Listings of an org's packs since the last `arm`.
    pub fn pack_listings(&self) -> u64 {
        lock(&self.counters).pack_listings
    }

    /// The objects a read of `len` bytes at `offset` of `key` covers, by
    /// their own keys: the key itself unless it is a pack.
    fn objects_read(&self, key: &str, offset: u64, len: u64) -> Vec<String> {
        let Some(KeyKind::Pack {
            org,
            pack,
            part: PackPart::Data,
        }) = parse_key(key)
        else {
            return vec![key.to_owned()];
        };
        let Ok(Some(bytes)) = self
            .inner
            .get(&Store::pack_key(&org, &pack, PackPart::Index))
        else {
            return Vec::new();
        };
        let Ok(index) = store::pack::decode_index(&org, &pack, &bytes) else {
            return Vec::new();
        };
        index
            .entries
            .iter()
            .filter(|e| e.offset < offset + len && e.offset + u64::from(e.length) > offset)
            .map(|e| Store::object_key(&org, &e.object))
            .collect()
    }

    /// A ranged read, counted (and failed, and slowed) per object it covers.
    fn range_counted(&self, key: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        lock(&self.counters).ranged_reads += 1;
        lock(&self.counters).read_requests += 1;
        let faults = lock(&self.faults).clone();
        for object in self.objects_read(key, offset, len) {
            let nth = {
                let mut counters = lock(&self.counters);
                let count = counters.gets.entry(object.clone()).or_default();
                *count += 1;
                *count
            };
            if let Some((fail_key, fail_nth)) = &faults.fail_get
                && *fail_key == object
                && *fail_nth == nth
            {
                return Err(injected("get", &object));
            }
        }
        if let Some(delay) = faults.get_delay {
            std::thread::sleep(delay);
        }
        self.inner.get_range(key, offset, len)
    }

    /// A pack's index being put: counts its objects and, under
    /// `refuse_incomplete_trees`, refuses a tree whose children are
    /// neither stored nor earlier in the pack.
    fn check_pack(&self, key: &str, data: &[u8]) -> Result<()> {
        let Some(KeyKind::Pack {
            org,
            pack,
            part: PackPart::Index,
        }) = parse_key(key)
        else {
            return Ok(());
        };
        let index = store::pack::decode_index(&org, &pack, data).expect("a sound index");
        lock(&self.counters).packs_written.push(index.entries.len());
        if !lock(&self.faults).refuse_incomplete_trees {
            return Ok(());
        }
        let bytes = self
            .inner
            .get(&Store::pack_key(&org, &pack, PackPart::Data))?
            .expect("the pack is put before its index");
        let mut present = object_keys(self.inner.as_ref());
        for entry in &index.entries {
            let stored = &bytes[entry.offset as usize..][..entry.length as usize];
            if entry.object.kind == ObjectKind::Tree {
                let plain = store::block::decode(&entry.object.digest, stored)?;
                let tree = store::tree::Tree::decode(&entry.object.digest, &plain)?;
                for child in store::objects::children(&tree) {
                    if !present.contains(&Store::object_key(&org, &child)) {
                        return Err(Error::IncompleteTree {
                            root: entry.object.digest,
                            missing: 1,
                        });
                    }
                }
            }
            present.insert(Store::object_key(&org, &entry.object));
        }
        Ok(())
    }

    /// A read of `key`, counted per key, failing where `fail_get` says.
    fn get_counted(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let nth = {
            let mut counters = lock(&self.counters);
            let count = counters.gets.entry(key.to_owned()).or_default();
            *count += 1;
            *count
        };
        let faults = lock(&self.faults).clone();
        if let Some((fail_key, fail_nth)) = &faults.fail_get
            && fail_key == key
            && *fail_nth == nth
        {
            return Err(injected("get", key));
        }
        if let Some(delay) = faults.get_delay {
            std::thread::sleep(delay);
        }
        self.inner.get(key)
    }

    /// The block service's rule: every tree in `batch` names only objects
    /// already stored or earlier in the batch.
    fn check_trees(&self, batch: &[(String, &[u8])]) -> Result<()> {
        let mut earlier: HashSet<&str> = HashSet::new();
        for (key, data) in batch {
            if let Some(KeyKind::Object { org, object }) = parse_key(key)
                && object.kind == ObjectKind::Tree
            {
                let plain = store::block::decode(&object.digest, data)?;
                let tree = store::tree::Tree::decode(&object.digest, &plain)?;
                for child in store::objects::children(&tree) {
                    let child = Store::object_key(&org, &child);
                    if !earlier.contains(child.as_str())
                        && self.inner.exists(std::slice::from_ref(&child))? != [true]
                    {
                        return Err(Error::IncompleteTree {
                            root: object.digest,
                            missing: 1,
                        });
                    }
                }
            }
            earlier.insert(key);
        }
        Ok(())
    }
}

impl Backend for Double {
    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        self.put_batch(&[(key.to_owned(), data)])
    }

    fn put_batch(&self, objects: &[(String, &[u8])]) -> Result<()> {
        if lock(&self.faults).refuse_incomplete_trees {
            self.check_trees(objects)?;
        }
        for (key, data) in objects {
            self.check_pack(key, data)?;
        }
        self.inner.put_batch(objects)
    }

    fn put_durable(&self, key: &str, data: &[u8]) -> Result<()> {
        self.inner.put_durable(key, data)
    }

    fn sync(&self) -> Result<()> {
        self.inner.sync()
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        lock(&self.counters).single_gets += 1;
        lock(&self.counters).read_requests += 1;
        self.get_counted(key)
    }

    fn get_batch(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>> {
        lock(&self.counters).get_batches.push(keys.len());
        lock(&self.counters).read_requests += keys.len() as u64;
        keys.iter().map(|key| self.get_counted(key)).collect()
    }

    fn reads_in_batches(&self) -> bool {
        self.reads_in_batches
    }

    fn get_range(&self, key: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        lock(&self.counters).single_gets += 1;
        self.range_counted(key, offset, len)
    }

    fn get_ranges(&self, ranges: &[(String, u64, u64)]) -> Result<Vec<Option<Vec<u8>>>> {
        let objects: usize = ranges
            .iter()
            .map(|(key, offset, len)| self.objects_read(key, *offset, *len).len())
            .sum();
        lock(&self.counters).get_batches.push(objects);
        ranges
            .iter()
            .map(|(key, offset, len)| self.range_counted(key, *offset, *len))
            .collect()
    }

    /// A batch of the objects the range covers, read as `get_range` is,
    /// handed on in pieces.
    fn get_range_each(
        &self,
        key: &str,
        offset: u64,
        len: u64,
        each: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<bool> {
        let objects = self.objects_read(key, offset, len).len();
        lock(&self.counters).get_batches.push(objects);
        let Some(bytes) = self.range_counted(key, offset, len)? else {
            return Ok(false);
        };
        let mut handed = 0;
        for piece in bytes.chunks(RANGE_PIECE_BYTES) {
            if handed > 0
                && let Some(hook) = lock(&self.between_range_pieces).as_mut()
            {
                hook(handed, bytes.len() as u64);
            }
            each(piece)?;
            handed += piece.len() as u64;
        }
        Ok(true)
    }

    fn exists(&self, keys: &[String]) -> Result<Vec<bool>> {
        let nth = {
            let mut counters = lock(&self.counters);
            counters.exists_batches.push(keys.len());
            counters.exists_calls += 1;
            counters.exists_calls
        };
        let present = self.inner.exists(keys)?;
        let delayed_call = lock(&self.faults).delay_exists_call;
        if let Some((delayed, delay)) = delayed_call
            && delayed == nth
        {
            std::thread::sleep(delay);
        }
        Ok(present)
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let nth = {
            let mut counters = lock(&self.counters);
            counters.lists += 1;
            counters.lists
        };
        if lock(&self.faults).fail_list_call == Some(nth) {
            return Err(injected("list", prefix));
        }
        if !prefix.ends_with("/packs/") {
            return self.inner.list(prefix);
        }
        // An org's packs listed: a store's existence check.
        let nth = {
            let mut counters = lock(&self.counters);
            counters.pack_listings += 1;
            counters.exists_calls += 1;
            counters.exists_calls
        };
        let listed = self.inner.list(prefix)?;
        let delayed_call = lock(&self.faults).delay_exists_call;
        if let Some((delayed, delay)) = delayed_call
            && delayed == nth
        {
            std::thread::sleep(delay);
        }
        Ok(listed)
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        self.inner.head(key)
    }

    fn delete(&self, key: &str) -> Result<()> {
        {
            // Held while the hook runs, so no delete overtakes it.
            let mut hook = lock(&self.before_first_delete);
            if let Some(hook) = hook.take() {
                hook();
            }
        }
        {
            let mut counters = lock(&self.counters);
            if let Some(limit) = lock(&self.faults).fail_delete_after
                && counters.deletes >= limit
            {
                return Err(injected("delete", key));
            }
            counters.deletes += 1;
        }
        self.inner.delete(key)
    }
}
