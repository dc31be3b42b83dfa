//! Imported images on this host: materialised from the org's content store
//! through the control plane's block service, once per root tree.
//!
//! ```text
//! DIR/images/ROOT/        a complete image tree, never changed once here
//!                         (the read-only lower layer of its sandboxes);
//!                         its modification time is its last use
//! DIR/images/.tmp-ROOT-N  a materialisation in progress, or a tree being
//!                         removed (removed at start)
//! DIR/image-sizes/ROOT    the tree's bytes, counted once
//! DIR/block-cache/        objects fetched before: a new version of an image
//!                         downloads only the blocks this host lacks
//! DIR/sandboxes/ID/image  the tree sandbox ID launches on, written before
//!                         it is asked for
//! ```
//!
//! A tree is renamed into place only once complete, so a runner killed
//! mid-download leaves nothing that looks usable.
//!
//! # What stays
//!
//! Trees and the block cache are kept while they take at most the
//! runner's `--image-cache-max` together ([`Images::collect`], run after
//! each new materialisation): past it, trees no sandbox on this host uses
//! go, least recently used first, then the block cache (only a shortcut).
//! A tree is used by a sandbox whose directory names it (`image`, above)
//! or by a mounted overlay whose lower layer it is (a sandbox launched by
//! a runner from before the names). So an org importing image after
//! image cannot fill a runner's disk with trees, and a sandbox stopped
//! here starts again on its tree. Removing a tree takes its
//! materialisation lock, the one a launch takes to find it, after the
//! launch has named it: a tree is never taken from a launch under way.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use store::pull::{PullOptions, materialize};
use store::{Digest, OrgId};

use super::homes::NotReady;
use oci::{Error, Result};

pub(crate) struct Images {
    dir: PathBuf,
    cache: PathBuf,
    /// Each tree's bytes (`DIR/image-sizes/ROOT`).
    sizes: PathBuf,
    /// Where sandboxes' directories are (each names its tree).
    sandboxes: PathBuf,
    /// The most trees and the block cache may take together before
    /// unused trees go ([`Images::collect`]); `None`: no bound.
    bytes_max: Option<u64>,
    /// Set by a new materialisation: a collection is due.
    grew: AtomicBool,
    /// One materialisation of a root at a time: launches of the same
    /// image wait for the one under way and use its tree, instead of each
    /// downloading (and storing) its own copy.
    downloads: std::sync::Mutex<std::collections::HashMap<Digest, Arc<tokio::sync::Mutex<()>>>>,
    /// Materialisations under way at once, whatever their roots
    /// ([`DOWNLOADS_AT_ONCE`]): each holds an image's trees in memory.
    at_once: tokio::sync::Semaphore,
}

/// Images materialised at once on a runner.
const DOWNLOADS_AT_ONCE: usize = 2;

impl Images {
    /// Prepares `data_root/images` (dropping half-made trees) and the
    /// block cache beside it; trees and cache are kept within `bytes_max`.
    pub(crate) fn open(data_root: &Path, bytes_max: Option<u64>) -> Result<Images> {
        let dir = data_root.join("images");
        let cache = data_root.join("block-cache");
        let sizes = data_root.join("image-sizes");
        for path in [&dir, &cache, &sizes] {
            std::fs::create_dir_all(path).map_err(|e| Error::io("create directory", path, e))?;
        }
        let listing = std::fs::read_dir(&dir).map_err(|e| Error::io("list", &dir, e))?;
        for entry in listing.flatten() {
            if entry.file_name().to_string_lossy().starts_with(".tmp-") {
                // A tree an org made, of any depth.
                oci::host::remove_tree(&entry.path())?;
            }
        }
        Ok(Images {
            dir,
            cache,
            sizes,
            sandboxes: data_root.join("sandboxes"),
            bytes_max,
            // A collection at start: a bound lowered since, or trees a
            // runner from before the bound left.
            grew: AtomicBool::new(true),
            downloads: std::sync::Mutex::default(),
            at_once: tokio::sync::Semaphore::new(DOWNLOADS_AT_ONCE),
        })
    }

    /// The directory holding tree `root` of `org`'s store, materialised
    /// first if this host does not have it yet. A store out of reach or
    /// full is [`NotReady::Store`]: the launch waits and tries again. This
    /// runner's disk full fails the launch ([`NotReady::of_pull`]). A
    /// pull that fails, either way, leaves no partial `.tmp-` tree.
    pub(crate) async fn materialised(
        &self,
        control: &dyn super::control::ControlPlane,
        org: &str,
        root: &str,
    ) -> std::result::Result<PathBuf, NotReady> {
        let digest: Digest = root
            .parse()
            .map_err(|_| Error::Invalid(format!("image root {root:?} is not a digest")))?;
        let org: OrgId = org
            .parse()
            .map_err(|_| Error::Invalid(format!("org {org:?} is not a store org")))?;
        let dest = self.dir.join(digest.to_hex());
        // Looked for under the root's lock, which a collection removing the
        // tree holds (see the module docs).
        let download = self.root_lock(&digest);
        let _this_root = download.lock().await;
        // Here already, or made by the materialisation this one waited for.
        if dest.is_dir() {
            touch(&dest);
            return Ok(dest);
        }
        let _turn = self
            .at_once
            .acquire()
            .await
            .map_err(|_| Error::Invalid("the runner is stopping".to_owned()))?;
        static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let temp = self.dir.join(format!(".tmp-{}-{n}", digest.to_hex()));
        let backend = control.blocks();
        let options = PullOptions {
            cache: Some(self.cache.clone()),
            fill_cache: true,
            index_path: None,
            store_id: "control-plane".to_owned(),
            index_dev: None,
            check_room: true,
            room_also: None,
        };
        let (work_temp, work_dest) = (temp.clone(), dest.clone());
        let size_file = self.sizes.join(digest.to_hex());
        let done = tokio::task::spawn_blocking(move || -> std::result::Result<(), NotReady> {
            let report = materialize(
                &backend,
                &org,
                "image",
                &digest,
                &work_temp,
                &options,
                &store::progress::NoProgress,
            )
            .map_err(|e| NotReady::of_pull(&e, "the image", &digest, &work_temp))?;
            tracing::info!(
                image_root = %digest,
                files = report.files,
                blocks_downloaded = report.blocks_downloaded,
                bytes_downloaded = report.bytes_downloaded,
                blocks_from_cache = report.blocks_from_cache,
                "image materialised"
            );
            // Counted before it is in place: a tree in place has its size.
            let bytes = tree_bytes(&work_temp)?;
            oci::host::write_durably(&size_file, bytes.to_string().as_bytes())?;
            match std::fs::rename(&work_temp, &work_dest) {
                Ok(()) => Ok(()),
                // Another sandbox's materialisation of the same tree won.
                Err(_) if work_dest.is_dir() => std::fs::remove_dir_all(&work_temp)
                    .map_err(|e| Error::io("remove", &work_temp, e).into()),
                Err(e) => Err(Error::io("rename into place", &work_temp, e).into()),
            }
        })
        .await;
        match done {
            Ok(Ok(())) => {
                self.grew.store(true, Ordering::Relaxed);
                Ok(dest)
            }
            Ok(Err(err)) => {
                let _ = std::fs::remove_dir_all(&temp);
                if matches!(err, NotReady::DiskFull(_)) {
                    // Unused trees may be what fills the disk.
                    self.grew.store(true, Ordering::Relaxed);
                }
                Err(err)
            }
            Err(join) => {
                let _ = std::fs::remove_dir_all(&temp);
                Err(Error::Invalid(format!("image materialisation failed: {join}")).into())
            }
        }
    }
}

impl Images {
    /// The lock a materialisation of `root` and the removal of its tree
    /// take.
    fn root_lock(&self, root: &Digest) -> Arc<tokio::sync::Mutex<()>> {
        self.downloads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(*root)
            .or_default()
            .clone()
    }

    /// Whether a collection is due (a tree was materialised since the
    /// last one, or none ran yet).
    pub(crate) fn collection_due(&self) -> bool {
        self.bytes_max.is_some() && self.grew.load(Ordering::Relaxed)
    }

    /// Keeps trees and the block cache within the bound: while they take
    /// more, the least recently used tree no sandbox here uses goes, then
    /// the block cache. Returns the trees removed.
    pub(crate) async fn collect(self: &Arc<Self>) -> Result<Vec<Digest>> {
        let Some(bytes_max) = self.bytes_max else {
            return Ok(Vec::new());
        };
        self.grew.store(false, Ordering::Relaxed);
        let collected = self.collect_within(bytes_max).await;
        if collected.is_err() {
            // Tried again at the next look.
            self.grew.store(true, Ordering::Relaxed);
        }
        collected
    }

    async fn collect_within(self: &Arc<Self>, bytes_max: u64) -> Result<Vec<Digest>> {
        let images = self.clone();
        let (mut total, candidates) =
            oci::host::blocking("count the image trees", &self.dir, move || images.survey())
                .await?;
        let mut removed = Vec::new();
        for (root, bytes) in candidates {
            if total <= bytes_max {
                break;
            }
            // A launch under way for this root holds it: the tree is
            // wanted; left for a later collection.
            let lock = self.root_lock(&root);
            let Ok(_held) = lock.try_lock() else {
                continue;
            };
            let images = self.clone();
            let gone = oci::host::blocking("remove an image tree", &self.dir, move || {
                images.remove_unused(&root)
            })
            .await?;
            if gone {
                total = total.saturating_sub(bytes);
                removed.push(root);
            }
        }
        if total > bytes_max {
            // Only a shortcut for later materialisations: emptied when
            // none is under way.
            if let Ok(_all) = self.at_once.try_acquire_many(DOWNLOADS_AT_ONCE as u32) {
                let cache = self.cache.clone();
                oci::host::blocking("empty the block cache", &self.cache, move || {
                    empty_dir(&cache)
                })
                .await?;
            }
        }
        Ok(removed)
    }

    /// The bytes trees and the block cache take, and the trees no sandbox
    /// here uses with their bytes, least recently used first.
    fn survey(&self) -> Result<(u64, Vec<(Digest, u64)>)> {
        let Some(used) = self.used()? else {
            tracing::info!(
                "image trees are not collected while a sandbox here launched by an older runner may use any of them"
            );
            return Ok((0, Vec::new()));
        };
        let mut total = tree_bytes(&self.cache)?;
        let mut unused = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(|e| Error::io("list", &self.dir, e))? {
            let entry = entry.map_err(|e| Error::io("list", &self.dir, e))?;
            let Some(root) = entry
                .file_name()
                .to_str()
                .and_then(|name| name.parse::<Digest>().ok())
            else {
                continue;
            };
            let bytes = self.tree_size(&root)?;
            total += bytes;
            if !used.contains(&root) {
                let last_use = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                unused.push((last_use, root, bytes));
            }
        }
        unused.sort();
        Ok((
            total,
            unused
                .into_iter()
                .map(|(_, root, bytes)| (root, bytes))
                .collect(),
        ))
    }

    /// A tree's bytes: as counted when it was materialised, else counted
    /// now (a tree from before the count) and kept.
    fn tree_size(&self, root: &Digest) -> Result<u64> {
        let file = self.sizes.join(root.to_hex());
        if let Some(bytes) = std::fs::read_to_string(&file)
            .ok()
            .and_then(|text| text.trim().parse().ok())
        {
            return Ok(bytes);
        }
        let bytes = tree_bytes(&self.dir.join(root.to_hex()))?;
        oci::host::write_durably(&file, bytes.to_string().as_bytes())?;
        Ok(bytes)
    }

    /// The trees sandboxes here use: named in their directories, or the
    /// lower layer of a mounted overlay. `None`: a sandbox here may use
    /// any tree (one launched on an imported image by a runner from before
    /// trees were named, until it launches again or goes), so none may go.
    /// Anything unreadable fails the collection rather than count as
    /// unused.
    fn used(&self) -> Result<Option<HashSet<Digest>>> {
        let mut used = HashSet::new();
        let listing = match std::fs::read_dir(&self.sandboxes) {
            Ok(listing) => Some(listing),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io("list", &self.sandboxes, e)),
        };
        for entry in listing.into_iter().flatten() {
            let entry = entry.map_err(|e| Error::io("list", &self.sandboxes, e))?;
            let named = entry.path().join("image");
            match std::fs::read_to_string(&named) {
                Ok(text) => {
                    let root = text.trim().parse::<Digest>().map_err(|_| {
                        Error::Invalid(format!("{} names no tree", named.display()))
                    })?;
                    used.insert(root);
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // An image's writable layer with no tree named: an
                    // older runner's launch (a host-image sandbox has none).
                    if entry.path().join("upper").exists() {
                        return Ok(None);
                    }
                }
                Err(e) => return Err(Error::io("read", &named, e)),
            }
        }
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| Error::io("read", Path::new("/proc/self/mountinfo"), e))?;
        let prefix = format!("lowerdir={}/", self.dir.display());
        for line in mountinfo.lines() {
            for option in line.split(',') {
                let option = oci::host::unescape_mountinfo(option);
                let Some(lower) = option.split_once(&prefix).map(|(_, rest)| rest) else {
                    continue;
                };
                if let Some(root) = lower
                    .split(['/', ':', ' '])
                    .next()
                    .and_then(|hex| hex.parse::<Digest>().ok())
                {
                    used.insert(root);
                }
            }
        }
        Ok(Some(used))
    }

    /// Removes the tree of `root` unless a sandbox here uses it (asked
    /// again under its lock: a launch names its tree before it takes the
    /// lock). Whether it went.
    fn remove_unused(&self, root: &Digest) -> Result<bool> {
        if self.used()?.is_none_or(|used| used.contains(root)) {
            return Ok(false);
        }
        static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let tree = self.dir.join(root.to_hex());
        let going = self.dir.join(format!(".tmp-{}-gc-{n}", root.to_hex()));
        match std::fs::rename(&tree, &going) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(Error::io("set aside", &tree, e)),
        }
        oci::host::remove_tree(&going)?;
        let _ = std::fs::remove_file(self.sizes.join(root.to_hex()));
        tracing::info!(image_root = %root, "an image tree no sandbox here uses was removed (--image-cache-max)");
        Ok(true)
    }
}

/// Marks a tree used now (its modification time: nothing else changes a
/// tree once in place).
fn touch(tree: &Path) {
    if let Ok(dir) = std::fs::File::open(tree) {
        let _ = dir.set_modified(std::time::SystemTime::now());
    }
}

/// The bytes of the files under `dir` (of any depth: walked with a list,
/// not a stack of calls), symlinks not followed; nothing there is 0.
fn tree_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0u64;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let listing = match std::fs::read_dir(&dir) {
            Ok(listing) => listing,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io("list", &dir, e)),
        };
        for entry in listing {
            let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
            let Ok(metadata) = entry.metadata() else {
                continue;
            };
            if metadata.is_dir() {
                pending.push(entry.path());
            } else {
                // What it takes on disk, holes not counted.
                total += metadata.blocks() * 512;
            }
        }
    }
    Ok(total)
}

/// Removes everything in `dir`, keeping `dir`.
fn empty_dir(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))? {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        oci::host::remove_tree(&entry.path())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a sandbox here uses is read from its directory; one an older
    /// runner launched on an image (a writable layer, no tree named)
    /// may use any, and holds them all.
    #[test]
    fn the_trees_in_use_are_those_sandboxes_name_and_an_unnamed_one_holds_all() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let images = Images::open(tmp.path(), Some(1)).expect("open");
        let root = Digest::of(b"a tree");
        let sandboxes = tmp.path().join("sandboxes");
        assert_eq!(images.used().expect("read"), Some(HashSet::new()));
        std::fs::create_dir_all(sandboxes.join("sbx_new")).expect("mkdir");
        std::fs::write(sandboxes.join("sbx_new/image"), root.to_hex()).expect("name");
        // A host-image sandbox names nothing and holds nothing.
        std::fs::create_dir_all(sandboxes.join("sbx_host/rootfs")).expect("mkdir");
        assert_eq!(images.used().expect("read"), Some(HashSet::from([root])));
        std::fs::create_dir_all(sandboxes.join("sbx_old/upper")).expect("mkdir");
        assert_eq!(images.used().expect("read"), None);
        std::fs::remove_dir_all(sandboxes.join("sbx_old")).expect("rm");
        // A name that is no tree fails the collection, never counts as
        // nothing used.
        std::fs::write(sandboxes.join("sbx_new/image"), "garbage").expect("write");
        assert!(images.used().is_err());
    }
}
