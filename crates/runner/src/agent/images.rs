//! Imported images on this host: materialised from the org's content store
//! through the control plane's block service, once per root tree.
//!
//! ```text
//! DIR/images/ROOT/        a complete image tree, never changed once here
//!                         (the read-only lower layer of its sandboxes)
//! DIR/images/.tmp-ROOT-N  a materialisation in progress (removed at start)
//! DIR/block-cache/        objects fetched before: a new version of an image
//!                         downloads only the blocks this host lacks
//! ```
//!
//! A tree is renamed into place only once complete, so a runner killed
//! mid-download leaves nothing that looks usable.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use store::pull::{PullOptions, materialize};
use store::{Digest, OrgId};

use super::homes::NotReady;
use oci::{Error, Result};

pub(crate) struct Images {
    dir: PathBuf,
    cache: PathBuf,
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
    /// block cache beside it.
    pub(crate) fn open(data_root: &Path) -> Result<Images> {
        let dir = data_root.join("images");
        let cache = data_root.join("block-cache");
        for path in [&dir, &cache] {
            std::fs::create_dir_all(path).map_err(|e| Error::io("create directory", path, e))?;
        }
        let listing = std::fs::read_dir(&dir).map_err(|e| Error::io("list", &dir, e))?;
        for entry in listing.flatten() {
            if entry.file_name().to_string_lossy().starts_with(".tmp-") {
                let path = entry.path();
                std::fs::remove_dir_all(&path).map_err(|e| Error::io("remove", &path, e))?;
            }
        }
        Ok(Images {
            dir,
            cache,
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
        if dest.is_dir() {
            return Ok(dest);
        }
        let download = self
            .downloads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(digest)
            .or_default()
            .clone();
        let _this_root = download.lock().await;
        // Made by the materialisation this one waited for.
        if dest.is_dir() {
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
            Ok(Ok(())) => Ok(dest),
            Ok(Err(err)) => {
                let _ = std::fs::remove_dir_all(&temp);
                Err(err)
            }
            Err(join) => {
                let _ = std::fs::remove_dir_all(&temp);
                Err(Error::Invalid(format!("image materialisation failed: {join}")).into())
            }
        }
    }
}
