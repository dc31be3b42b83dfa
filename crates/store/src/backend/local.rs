//! A local directory as object store: the embedded default.
//!
//! Objects are plain files named by their key. A put writes a temporary
//! file and renames it into place, so a reader never sees half an object;
//! puts skip per-file fsync and [`Backend::sync`] flushes the whole
//! filesystem once (`syncfs`) before a push commits. Mutable pointers use
//! the full temp → fsync → rename → fsync-directory sequence.

use std::fs;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Backend, ObjectMeta};
use crate::{Error, Result};

const TEMP_PREFIX: &str = ".tmp.";

pub struct LocalBackend {
    root: PathBuf,
    temp_counter: AtomicU64,
    /// Files opened for ranged reads (packs), kept open: reading many
    /// objects of a pack costs one `openat`, not one per object. Forgotten
    /// when this backend puts or deletes the key; a file another process
    /// removed still reads as it was (packs are immutable, every read is
    /// verified), so this only ever serves bytes that were stored.
    open_files: std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<fs::File>>>,
}

/// Files kept open for ranged reads at most (then all are closed).
const OPEN_FILES_MAX: usize = 256;

/// A local store's failures are file errors: they name the file (a full
/// disk or a permission problem is then plain to see), not "unreachable".
fn local_error(root: &Path, key: &str, err: std::io::Error) -> Error {
    Error::Io {
        path: root.join(key),
        source: err,
    }
}

impl LocalBackend {
    /// The store at `root`, made if absent (writers: a push, a copy's
    /// target, the server).
    pub fn open(root: impl AsRef<Path>) -> Result<LocalBackend> {
        let root = root.as_ref().to_owned();
        fs::create_dir_all(&root).map_err(|e| local_error(&root, "", e))?;
        Ok(LocalBackend::at(root))
    }

    /// The store at `root`, which must exist: [`Error::NoStore`] if it
    /// does not, and nothing is made (readers: a mistyped path must not
    /// pass for an empty store).
    pub fn open_existing(root: impl AsRef<Path>) -> Result<LocalBackend> {
        let root = root.as_ref().to_owned();
        match fs::metadata(&root) {
            Ok(metadata) if metadata.is_dir() => Ok(LocalBackend::at(root)),
            Ok(_) => Err(Error::NoStore { path: root }),
            Err(err) if err.kind() == ErrorKind::NotFound => Err(Error::NoStore { path: root }),
            Err(err) => Err(local_error(&root, "", err)),
        }
    }

    fn at(root: PathBuf) -> LocalBackend {
        LocalBackend {
            root,
            temp_counter: AtomicU64::new(0),
            open_files: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        // Keys are built by `Store` from validated names and hex digests;
        // this guard keeps a future caller's bug from escaping the root.
        if key.is_empty()
            || key.starts_with('/')
            || key
                .split('/')
                .any(|p| p.is_empty() || p == "." || p == "..")
        {
            return Err(Error::Backend {
                op: "resolve",
                key: key.to_owned(),
                message: "invalid key".to_owned(),
            });
        }
        Ok(self.root.join(key))
    }

    fn temp_path(&self, path: &Path) -> PathBuf {
        let n = self.temp_counter.fetch_add(1, Ordering::Relaxed);
        let name = format!("{TEMP_PREFIX}{}.{}", std::process::id(), n);
        path.with_file_name(name)
    }

    fn write_new(&self, key: &str, data: &[u8], durable: bool) -> Result<()> {
        let path = self.path(key)?;
        // A file put again is read anew.
        self.open_files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
        let temp = self.temp_path(&path);
        let write = |temp: &Path| -> std::io::Result<()> {
            let mut file = fs::File::create(temp)?;
            file.write_all(data)?;
            if durable {
                file.sync_all()?;
            }
            Ok(())
        };
        if let Err(err) = write(&temp) {
            if err.kind() != ErrorKind::NotFound {
                let _ = fs::remove_file(&temp);
                return Err(local_error(&self.root, key, err));
            }
            // The fan-out directory does not exist yet.
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(|e| local_error(&self.root, key, e))?;
            }
            write(&temp).map_err(|e| {
                let _ = fs::remove_file(&temp);
                local_error(&self.root, key, e)
            })?;
        }
        fs::rename(&temp, &path).map_err(|e| {
            let _ = fs::remove_file(&temp);
            local_error(&self.root, key, e)
        })?;
        if durable && let Some(parent) = path.parent() {
            fs::File::open(parent)
                .and_then(|dir| dir.sync_all())
                .map_err(|e| local_error(&self.root, key, e))?;
        }
        Ok(())
    }

    fn meta(&self, key: String, metadata: &fs::Metadata) -> Result<ObjectMeta> {
        let last_modified = metadata
            .modified()
            .map_err(|e| local_error(&self.root, &key, e))?;
        Ok(ObjectMeta {
            key,
            size: metadata.len(),
            last_modified,
        })
    }

    fn list_into(&self, dir: &Path, key_prefix: &str, out: &mut Vec<ObjectMeta>) -> Result<()> {
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(err) if err.kind() == ErrorKind::NotFound => return Ok(()),
            Err(err) => return Err(local_error(&self.root, key_prefix, err)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| local_error(&self.root, key_prefix, e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with(TEMP_PREFIX) {
                continue;
            }
            let key = format!("{key_prefix}{name}");
            // An entry removed between readdir and stat (a lock released,
            // a gc deleting) is simply not part of this listing.
            let metadata = match entry.metadata() {
                Ok(metadata) => metadata,
                Err(err) if err.kind() == ErrorKind::NotFound => continue,
                Err(err) => return Err(local_error(&self.root, &key, err)),
            };
            if metadata.is_dir() {
                self.list_into(&entry.path(), &format!("{key}/"), out)?;
            } else if metadata.is_file() {
                out.push(self.meta(key, &metadata)?);
            }
        }
        Ok(())
    }
}

impl Backend for LocalBackend {
    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        self.write_new(key, data, false)
    }

    fn put_durable(&self, key: &str, data: &[u8]) -> Result<()> {
        self.write_new(key, data, true)
    }

    fn put_owned_durable(&self, key: &str, data: Vec<u8>) -> Result<()> {
        self.write_new(key, &data, true)
    }

    fn sync(&self) -> Result<()> {
        let root = fs::File::open(&self.root).map_err(|e| local_error(&self.root, "", e))?;
        rustix::fs::syncfs(&root).map_err(|e| local_error(&self.root, "", e.into()))
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match fs::read(self.path(key)?) {
            Ok(data) => Ok(Some(data)),
            Err(err) if err.kind() == ErrorKind::NotFound => Ok(None),
            Err(err) => Err(local_error(&self.root, key, err)),
        }
    }

    /// One open and positioned reads, never the whole file.
    fn get_range(&self, key: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        use std::os::unix::fs::FileExt;
        let cached = self
            .open_files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .cloned();
        let file = match cached {
            Some(file) => file,
            None => {
                let file = match fs::File::open(self.path(key)?) {
                    Ok(file) => std::sync::Arc::new(file),
                    Err(err) if err.kind() == ErrorKind::NotFound => return Ok(None),
                    Err(err) => return Err(local_error(&self.root, key, err)),
                };
                let mut open = self.open_files.lock().unwrap_or_else(|p| p.into_inner());
                if open.len() >= OPEN_FILES_MAX {
                    open.clear();
                }
                open.insert(key.to_owned(), std::sync::Arc::clone(&file));
                file
            }
        };
        let len = usize::try_from(len).map_err(|_| Error::Backend {
            op: "get",
            key: key.to_owned(),
            message: format!("range of {len} bytes"),
        })?;
        let mut out = vec![0u8; len];
        let mut read = 0;
        while read < len {
            match file.read_at(&mut out[read..], offset + read as u64) {
                Ok(0) => break,
                Ok(n) => read += n,
                Err(err) if err.kind() == ErrorKind::Interrupted => {}
                Err(err) => return Err(local_error(&self.root, key, err)),
            }
        }
        out.truncate(read);
        Ok(Some(out))
    }

    /// Stops at the first file found.
    fn any_under(&self, prefix: &str) -> Result<bool> {
        let mut stack = vec![self.path(prefix.trim_end_matches('/'))?];
        while let Some(dir) = stack.pop() {
            let entries = match fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(err) if err.kind() == ErrorKind::NotFound => continue,
                Err(err) => return Err(local_error(&self.root, prefix, err)),
            };
            for entry in entries {
                let entry = entry.map_err(|e| local_error(&self.root, prefix, e))?;
                if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
                    continue;
                }
                match entry.file_type() {
                    Ok(kind) if kind.is_dir() => stack.push(entry.path()),
                    Ok(kind) if kind.is_file() => return Ok(true),
                    Ok(_) => {}
                    Err(err) if err.kind() == ErrorKind::NotFound => {}
                    Err(err) => return Err(local_error(&self.root, prefix, err)),
                }
            }
        }
        Ok(false)
    }

    fn exists(&self, keys: &[String]) -> Result<Vec<bool>> {
        keys.iter()
            .map(|key| match fs::symlink_metadata(self.path(key)?) {
                Ok(_) => Ok(true),
                Err(err) if err.kind() == ErrorKind::NotFound => Ok(false),
                Err(err) => Err(local_error(&self.root, key, err)),
            })
            .collect()
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let dir = self.path(prefix.trim_end_matches('/'))?;
        let mut out = Vec::new();
        self.list_into(&dir, prefix, &mut out)?;
        Ok(out)
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        match fs::metadata(self.path(key)?) {
            Ok(metadata) => Ok(Some(self.meta(key.to_owned(), &metadata)?)),
            Err(err) if err.kind() == ErrorKind::NotFound => Ok(None),
            Err(err) => Err(local_error(&self.root, key, err)),
        }
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.open_files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
        match fs::remove_file(self.path(key)?) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == ErrorKind::NotFound => Ok(()),
            Err(err) => Err(local_error(&self.root, key, err)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_an_existing_store_makes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("mistyped");
        let err = LocalBackend::open_existing(&missing)
            .err()
            .expect("no store there");
        assert_eq!(
            err.to_string(),
            format!("no store at {}", missing.display())
        );
        assert!(!missing.exists(), "nothing made");
        let file = dir.path().join("file");
        fs::write(&file, b"x").expect("write");
        assert!(matches!(
            LocalBackend::open_existing(&file),
            Err(Error::NoStore { .. })
        ));
        // A writer makes it; a reader then finds it.
        LocalBackend::open(&missing).expect("made");
        LocalBackend::open_existing(&missing).expect("found");
    }
}
