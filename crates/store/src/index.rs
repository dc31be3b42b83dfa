//! The local file index: what lets a re-scan of an unchanged home skip
//! reading file contents.
//!
//! It maps `(dev, inode, size, mtime_ns, ctime_ns)`, as observed on this
//! machine, to the file's block digests. It is a cache: a missing, stale
//! or corrupt index only costs re-hashing, never a wrong result. Entries
//! are recorded only for files whose ctime was safely in the past when
//! observed (see [`is_racy`]), so a change made within the
//! filesystem's timestamp granularity cannot hide behind an equal stat.
//! Comparisons are between stats of the same filesystem, so timestamp
//! precision differences between filesystems never force a re-hash.
//!
//! File format v1: magic, version, the last push or pull (store, org,
//! home, root, its tree digests), the file entries, then a BLAKE3 checksum
//! of everything before it.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::midx::Hashing;
use crate::{Digest, Error, Result};

const MAGIC: &[u8; 5] = b"RIDX\x01";

/// Maps keyed by [`IndexKey`]. Stat values are not chosen by an attacker
/// who could aim for collisions, so a multiply-rotate hash stands in for
/// SipHash, which was a visible share of an unchanged re-push.
pub type FileMap<V> = HashMap<IndexKey, V, std::hash::BuildHasherDefault<KeyHasher>>;

#[derive(Default)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(23) ^ value).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_i64(&mut self, value: i64) {
        self.write_u64(value as u64);
    }
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IndexKey {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl IndexKey {
    pub fn of(meta: &fs::Metadata) -> IndexKey {
        IndexKey {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: mtime_ns(meta),
            ctime_ns: timestamp_ns(meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// How a scan or a pull takes index keys.
///
/// A home read through filesystem snapshots (btrfs) sees every snapshot on
/// a device number of its own, with the same inodes and times: `dev`
/// replaces the device number so one index serves every snapshot of a
/// home (and the home itself, where pulls write). A snapshot cannot change
/// after it was taken, so the racy-timestamp rule compares with the moment
/// it was taken (`observed_at_ns`), not with the time the scan reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyRule {
    pub dev: Option<u64>,
    pub observed_at_ns: Option<i64>,
}

impl KeyRule {
    pub fn key(&self, meta: &fs::Metadata) -> IndexKey {
        let mut key = IndexKey::of(meta);
        if let Some(dev) = self.dev {
            key.dev = dev;
        }
        key
    }

    /// [`is_racy`] at the moment the files were (or are being) observed.
    pub fn is_racy(&self, key: &IndexKey) -> bool {
        is_racy(key, self.observed_at_ns.unwrap_or_else(now_ns))
    }
}

pub fn mtime_ns(meta: &fs::Metadata) -> i64 {
    timestamp_ns(meta.mtime(), meta.mtime_nsec())
}

/// A stat timestamp (seconds and nanoseconds) as nanoseconds since the epoch.
pub fn timestamp_ns(seconds: i64, nanoseconds: i64) -> i64 {
    seconds
        .saturating_mul(1_000_000_000)
        .saturating_add(nanoseconds)
}

/// Timestamps are written from a coarse kernel clock (a few ms); on
/// filesystems with whole-second timestamps the window is two seconds.
const RACY_WINDOW_FINE_NS: i64 = 100_000_000;
const RACY_WINDOW_COARSE_NS: i64 = 2_000_000_000;

/// Whether a file's ctime is too close to `observed_at_ns` for an equal
/// stat later to prove equal content: a write landing in the same
/// timestamp tick after we looked would leave every field unchanged.
///
/// ctime alone decides. Every change to a file's content or times (write,
/// truncate, `utimensat`) sets its ctime to the kernel's clock, and no
/// call sets it to a chosen value; so once the tick of a recorded ctime
/// is over, any later change gives the file another ctime and the key no
/// longer matches. The mtime adds nothing: it is the ctime or earlier
/// unless someone set it, and a set mtime can be anything (`touch -d
/// 2100-01-01` made a file racy, so re-hashed, on every scan while the
/// rule took the later of the two).
pub fn is_racy(key: &IndexKey, observed_at_ns: i64) -> bool {
    let window = if key.ctime_ns % 1_000_000_000 == 0 {
        RACY_WINDOW_COARSE_NS
    } else {
        RACY_WINDOW_FINE_NS
    };
    key.ctime_ns.saturating_add(window) >= observed_at_ns
}

pub fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// The snapshot a directory was last pushed as or pulled from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LastSync {
    pub store: String,
    pub org: String,
    pub home: String,
    pub root: Digest,
    /// Every tree digest of `root`, so an incremental push can tell new
    /// objects from ones the store already holds without asking it.
    pub trees: Vec<Digest>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Index {
    pub files: FileMap<Vec<Digest>>,
    pub last: Option<LastSync>,
}

impl Index {
    /// Loads the index; anything unreadable is an empty index (it is a cache).
    pub fn load(path: &Path) -> Index {
        match fs::read(path) {
            Ok(bytes) => match decode(&bytes) {
                Some(index) => index,
                None => {
                    tracing::warn!(path = %path.display(), "discarding unreadable file index");
                    Index::default()
                }
            },
            Err(_) => Index::default(),
        }
    }

    /// Atomically replaces the index file.
    pub fn save(&self, path: &Path) -> Result<()> {
        save_with(path, self.last.as_ref(), |out| {
            encode_files(&self.files, out)
        })
    }
}

/// Writes an index to `path` atomically: its header with `last`, the file
/// records `files` writes, and the checksum. Streamed to the file, hashed
/// on the way: a 100k-file index is ~8 MB, which a push held at its peak
/// when it was built whole.
fn save_with(
    path: &Path,
    last: Option<&LastSync>,
    files: impl FnOnce(&mut Hashing<std::io::BufWriter<fs::File>>) -> std::io::Result<()>,
) -> Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(Error::io(parent))?;
    }
    let temp = path.with_extension(format!("tmp.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let file = fs::File::create(&temp)?;
        let mut out = Hashing {
            writer: std::io::BufWriter::with_capacity(256 * 1024, file),
            hasher: blake3::Hasher::new(),
        };
        encode_header(last, &mut out)?;
        files(&mut out)?;
        let Hashing { mut writer, hasher } = out;
        writer.write_all(hasher.finalize().as_bytes())?;
        writer.flush()?;
        drop(writer);
        fs::rename(&temp, path)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&temp);
        Error::Io {
            path: path.to_owned(),
            source: e,
        }
    })
}

/// A new unnamed file in `dir` (created if need be), readable and
/// writable by this process only, gone with its last handle.
pub(crate) fn unnamed_file_in(dir: &Path) -> std::io::Result<fs::File> {
    fs::create_dir_all(dir)?;
    let fd = rustix::fs::open(
        dir,
        rustix::fs::OFlags::TMPFILE | rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::from_raw_mode(0o600),
    )?;
    Ok(fs::File::from(fd))
}

/// A directory's file records set aside in an unnamed temporary file
/// beside its index (gone with the process, however it ends), in the
/// index's own encoding: what a push holds through its upload instead of
/// the records themselves (~13 MB at 100k files, a tenth of its peak).
/// They become the index at [`SpilledFiles::save`], once the push is done.
pub struct SpilledFiles {
    file: fs::File,
    count: usize,
}

impl SpilledFiles {
    /// Writes `files` aside for the index at `index_path`. `None` where no
    /// unnamed temporary file can be made there (the records then stay in
    /// memory, as before): a cache costs memory rather than fail a push.
    pub fn write(index_path: &Path, files: &FileMap<Vec<Digest>>) -> Option<SpilledFiles> {
        let dir = index_path.parent()?;
        let write = || -> std::io::Result<fs::File> {
            let mut writer = std::io::BufWriter::with_capacity(256 * 1024, unnamed_file_in(dir)?);
            encode_files(files, &mut writer)?;
            writer.into_inner().map_err(|e| e.into_error())
        };
        match write() {
            Ok(file) => Some(SpilledFiles {
                file,
                count: files.len(),
            }),
            Err(err) => {
                tracing::debug!(dir = %dir.display(), %err, "cannot set the file index aside; keeping it in memory");
                None
            }
        }
    }

    /// How many file records it holds.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Atomically replaces the index at `path` with these records and `last`.
    pub fn save(mut self, path: &Path, last: Option<&LastSync>) -> Result<()> {
        use std::io::Seek;
        self.file.rewind().map_err(Error::io(path))?;
        let mut records = std::io::BufReader::with_capacity(256 * 1024, &self.file);
        save_with(path, last, |out| {
            std::io::copy(&mut records, out).map(|_| ())
        })
    }
}

fn put_bytes(out: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    out.write_all(&(bytes.len() as u32).to_le_bytes())?;
    out.write_all(bytes)
}

/// Writes an index's header, with `last`, to `out`: what comes before
/// its file records.
fn encode_header(last: Option<&LastSync>, out: &mut impl Write) -> std::io::Result<()> {
    out.write_all(MAGIC)?;
    match last {
        Some(last) => {
            out.write_all(&[1])?;
            put_bytes(out, last.store.as_bytes())?;
            put_bytes(out, last.org.as_bytes())?;
            put_bytes(out, last.home.as_bytes())?;
            out.write_all(&last.root.0)?;
            out.write_all(&(last.trees.len() as u64).to_le_bytes())?;
            for tree in &last.trees {
                out.write_all(&tree.0)?;
            }
        }
        None => out.write_all(&[0])?,
    }
    Ok(())
}

/// Writes an index's file records (their count, then each) to `out`.
fn encode_files(files: &FileMap<Vec<Digest>>, out: &mut impl Write) -> std::io::Result<()> {
    out.write_all(&(files.len() as u64).to_le_bytes())?;
    for (key, blocks) in files {
        for n in [
            key.dev,
            key.ino,
            key.size,
            key.mtime_ns as u64,
            key.ctime_ns as u64,
        ] {
            out.write_all(&n.to_le_bytes())?;
        }
        out.write_all(&(blocks.len() as u32).to_le_bytes())?;
        for block in blocks {
            out.write_all(&block.0)?;
        }
    }
    Ok(())
}

fn decode(bytes: &[u8]) -> Option<Index> {
    let (body, checksum) = bytes.split_at_checked(bytes.len().checked_sub(32)?)?;
    if blake3::hash(body).as_bytes() != checksum {
        return None;
    }
    let mut at = 0usize;
    let mut take = |len: usize| -> Option<&[u8]> {
        let out = body.get(at..at.checked_add(len)?)?;
        at += len;
        Some(out)
    };
    if take(MAGIC.len())? != MAGIC {
        return None;
    }
    let u64_of = |b: &[u8]| b.try_into().ok().map(u64::from_le_bytes);
    let last = match take(1)?[0] {
        0 => None,
        _ => {
            let mut string = || -> Option<String> {
                let len = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
                String::from_utf8(take(len)?.to_vec()).ok()
            };
            let (store, org, home) = (string()?, string()?, string()?);
            let root = Digest(take(32)?.try_into().ok()?);
            let count = u64_of(take(8)?)? as usize;
            let trees = (0..count)
                .map(|_| Some(Digest(take(32)?.try_into().ok()?)))
                .collect::<Option<Vec<_>>>()?;
            Some(LastSync {
                store,
                org,
                home,
                root,
                trees,
            })
        }
    };
    let count = u64_of(take(8)?)? as usize;
    let mut files = FileMap::with_capacity_and_hasher(count.min(1 << 22), Default::default());
    for _ in 0..count {
        let mut n = || u64_of(take(8)?);
        let key = IndexKey {
            dev: n()?,
            ino: n()?,
            size: n()?,
            mtime_ns: n()? as i64,
            ctime_ns: n()? as i64,
        };
        let blocks_len = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
        let blocks = (0..blocks_len)
            .map(|_| Some(Digest(take(32)?.try_into().ok()?)))
            .collect::<Option<Vec<_>>>()?;
        files.insert(key, blocks);
    }
    (at == body.len()).then_some(Index { files, last })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_sync() -> LastSync {
        LastSync {
            store: "s".into(),
            org: "o".into(),
            home: "h".into(),
            root: Digest::of(b"root"),
            trees: vec![Digest::of(b"t")],
        }
    }

    #[test]
    fn round_trip_and_corruption_is_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("index");
        let mut index = Index::default();
        let key = IndexKey {
            dev: 1,
            ino: 2,
            size: 3,
            mtime_ns: 4,
            ctime_ns: 5,
        };
        index
            .files
            .insert(key, vec![Digest::of(b"a"), Digest::of(b"b")]);
        index.last = Some(last_sync());
        index.save(&path).expect("save");
        assert_eq!(Index::load(&path), index);
        let mut bytes = fs::read(&path).expect("read");
        bytes[10] ^= 1;
        fs::write(&path, bytes).expect("write");
        assert_eq!(Index::load(&path), Index::default());
    }

    /// Records set aside and saved later make the same index as records
    /// saved from memory, and the aside file leaves nothing behind.
    #[test]
    fn records_set_aside_save_the_same_index() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("index");
        let mut index = Index::default();
        for n in 0..1_000u64 {
            let key = IndexKey {
                dev: 1,
                ino: n,
                size: n * 7,
                mtime_ns: n as i64,
                ctime_ns: -(n as i64),
            };
            let blocks = (0..n % 3)
                .map(|b| Digest::of(&[n as u8, b as u8]))
                .collect();
            index.files.insert(key, blocks);
        }
        index.last = Some(last_sync());
        let spilled = SpilledFiles::write(&path, &index.files).expect("an unnamed temporary file");
        assert_eq!(spilled.len(), 1_000);
        spilled.save(&path, index.last.as_ref()).expect("save");
        assert_eq!(Index::load(&path), index);
        let names: Vec<_> = fs::read_dir(dir.path())
            .expect("read dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["index"], "only the index is left");
    }

    #[test]
    fn racy_window() {
        let second = 1_000_000_000;
        let key = |t: i64| IndexKey {
            dev: 0,
            ino: 0,
            size: 0,
            mtime_ns: t,
            ctime_ns: t,
        };
        assert!(is_racy(&key(100 * second + 5), 100 * second + 50));
        assert!(!is_racy(&key(100 * second + 5), 101 * second));
        // Whole-second timestamps: the filesystem cannot tell writes within
        // a second (or two, for FAT) apart.
        assert!(is_racy(&key(100 * second), 101 * second + 500));
        assert!(!is_racy(&key(100 * second), 103 * second));
        // Regression (audit): a file whose mtime was set in the future
        // (`touch -d 2100-01-01`) was racy on every scan, so re-hashed on
        // every save. Its ctime, which no call sets, decides.
        let future_mtime = IndexKey {
            mtime_ns: 4_102_444_800 * second,
            ..key(100 * second + 5)
        };
        assert!(!is_racy(&future_mtime, 101 * second));
        assert!(is_racy(&future_mtime, 100 * second + 50));
    }
}
