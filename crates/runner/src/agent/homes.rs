//! Homes on this runner, and their saves to the org's store (through the
//! control plane's block service; the runner holds no store credentials).
//!
//! ```text
//! DIR/volumes/homes/ID          the home: a btrfs subvolume where btrfs is
//!                               available (the data dir's own filesystem,
//!                               or DIR/homes.btrfs loop-mounted), else a
//!                               plain directory (see oci::volumes)
//! DIR/volumes/snapshots/ID/N    read-only snapshots being uploaded
//! DIR/home-state/ID.index       the home's file index: a save hashes only
//!                               what changed since the last one
//! DIR/home-state/ID.secured     the root a stop secured: while it names the
//!                               tree the home must start as, the home is
//!                               that tree already and nothing is pulled
//! DIR/home-state/ID.restoring   the home is being made a stored tree and
//!                               nothing has run in it since: an unfinished
//!                               restore (the store went away mid-wake) is
//!                               finished by the next attempt, never kept
//!                               aside as if it held work
//! DIR/home-state/ID.securing    the root a securing uploaded, written before
//!                               its commit: a copy kept aside after a crash
//!                               there names it, so the server can tell a
//!                               copy of the committed save from one with
//!                               unsaved writes
//! DIR/home-state/ID.kept.NAME   a kept copy's secured root (empty: the
//!                               copy may hold anything)
//! DIR/homes/ID                  homes of the earlier layout (plain), used
//!                               where they exist
//! DIR/volumes/kept/ID/NAME      copies of homes kept aside (see `kept`):
//!                               read-only, never mounted
//! ```
//!
//! A save of a running home is crash-consistent: a read-only snapshot
//! taken in one step (milliseconds whatever the home's size), uploaded
//! while the workload goes on, committed by the server only at this
//! placement's epoch. A stop's securing uploads the home itself, as nothing
//! runs in it any more. Index keys ignore the device number, which differs
//! for every snapshot (see `store::index::KeyRule`).

use api::lifecycle::StorageClass;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use api::failpoint::Failpoints;
use api::runners::{SandboxAssignment, SaveReport, SnapshotReport, WakeReport};
use store::excludes::Excludes;
use store::index::KeyRule;
use store::pull::{PullOptions, materialize};
use store::push::{PushReport, Since, Upload, UploadOptions, upload_tree};
use store::{Digest, OrgId};

use super::control::ControlPlane;
use super::{Refusal, refusal};
use oci::volumes::HomeVolumes;
use oci::{Error, Result};

/// The device number every index key of a home is taken with.
const INDEX_DEV: u64 = 0;

/// How the snapshots of running saves are named: `save-EPOCH-MS`.
const SAVE_SNAPSHOT_PREFIX: &str = "save-";

/// Why a save did not complete.
#[derive(Debug)]
pub(crate) enum SaveFailure {
    /// The placement is not this runner's any more: stop saving.
    Fenced(String),
    /// Worth reporting as the save's error, and trying again later.
    Failed(String),
    /// As `Failed`, where the room ran out: the store's, the org's bound
    /// on it (the block service's 507 or 429), or this runner's disk.
    /// Waiting a few seconds frees none of it: tried again after a
    /// longer pause than other failures.
    Full(String),
}

impl SaveFailure {
    /// What to report as the save's error (`Fenced`: why it stopped).
    pub(crate) fn message(&self) -> &str {
        match self {
            SaveFailure::Fenced(message)
            | SaveFailure::Failed(message)
            | SaveFailure::Full(message) => message,
        }
    }
}

impl From<Error> for SaveFailure {
    fn from(err: Error) -> SaveFailure {
        match &err {
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull => {
                SaveFailure::Full(err.to_string())
            }
            _ => SaveFailure::Failed(err.to_string()),
        }
    }
}

/// The store out of reach (the block service did not answer, or answered
/// that it cannot reach its own store) or full: nothing is wrong with what
/// is stored, and trying again later may succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoreWait {
    /// `store_unreachable` or `store_full` (`api::lifecycle::STARTING_WAIT_REASONS`).
    pub reason: &'static str,
    /// What failed, on one line.
    pub cause: String,
}

impl StoreWait {
    /// The wait a store error means, if it is one (`None`: anything else,
    /// a missing or corrupt object for example). Full means the store
    /// said so (the block service's 507), never this runner's own disk
    /// out of space: waiting does not free that, and a retried image pull
    /// filled it again each time.
    pub(crate) fn of(err: &store::Error, what: &str) -> Option<StoreWait> {
        let reason = if err.is_store_full() {
            "store_full"
        } else if matches!(err, store::Error::Backend { .. }) {
            "store_unreachable"
        } else {
            return None;
        };
        Some(StoreWait {
            reason,
            cause: format!("cannot download {what}: {err}"),
        })
    }
}

/// Why a home or an image is not ready for a launch.
#[derive(Debug)]
pub(crate) enum NotReady {
    /// The store is out of reach or full: the launch waits and tries again.
    Store(StoreWait),
    /// This runner's own disk has no space for the home or image: the
    /// launch fails with reason [`LOCAL_DISK_FULL`] (waiting frees
    /// nothing; the message names the disk and what was being written).
    DiskFull(String),
    /// Anything else; a permanent error fails the sandbox.
    Failed(Error),
}

impl From<Error> for NotReady {
    fn from(err: Error) -> NotReady {
        NotReady::Failed(err)
    }
}

/// The name of the read-only capture of a home taken for snapshot
/// `snapshot_id`.
fn capture_name(snapshot_id: &str) -> String {
    format!("snap-{snapshot_id}")
}

/// The reason a launch fails with when this runner's own disk has no
/// space for the home or image.
pub(crate) const LOCAL_DISK_FULL: &str = "runner_disk_full";

impl NotReady {
    /// What a failed pull of `what` (the home, the image) at `root` into
    /// `dest` means for the launch: the store out of reach or full is a
    /// wait ([`StoreWait`]); this runner's own disk out of space (the
    /// home's volume, the data disk under the images or the block cache)
    /// fails the launch, naming the disk, as does anything else (a missing
    /// or corrupt object, a tree past the store's bounds). The pull's
    /// client is the block service's, whose failures are all `Backend` or
    /// `StoreFull`: any I/O error is local.
    pub(crate) fn of_pull(err: &store::Error, what: &str, root: &Digest, dest: &Path) -> NotReady {
        if let Some(wait) = StoreWait::of(err, what) {
            return NotReady::Store(wait);
        }
        if err.is_disk_full() {
            return NotReady::DiskFull(format!(
                "no space left on this runner's disk for {what} {root} (writing {}): {err}",
                dest.display()
            ));
        }
        NotReady::Failed(Error::Unusable(format!(
            "cannot materialise {what} {root}: {err}"
        )))
    }
}

pub(crate) struct Homes {
    volumes: HomeVolumes,
    legacy: PathBuf,
    state: PathBuf,
    cache: PathBuf,
    excludes: Excludes,
    /// Crash-safety tests only (`crates/cli/tests/it/fault_matrix.rs`):
    /// `runner:save_before_upload`, `runner:save_mid_upload`,
    /// `runner:save_before_commit`, `runner:save_after_commit` kill the
    /// runner at that point of a running save (as a crash would);
    /// `runner:secure_before_upload`, `runner:secure_before_commit` (the
    /// home uploaded, not committed) and `runner:secure_after_commit` (the
    /// server committed it; the runner has neither recorded the root it
    /// secured nor reported `stopped`) at that point of a stop's securing.
    /// (`runner:save_mid_upload` fires in any upload, securing included.)
    failpoint: Failpoints,
    /// The tree each durable home running here is known to equal as of its
    /// restore or last completed save: a scheduled save that finds the
    /// home still so uploads and commits nothing (a parked sandbox). Only
    /// in memory: after a restart the next save is a whole one.
    saved_roots: std::sync::Mutex<std::collections::HashMap<String, Digest>>,
    /// Unit tests only: durable homes offered without btrfs (the fakes have
    /// none), so a worker launches them; saves of running homes still fail.
    #[cfg(test)]
    pub(crate) durable_without_btrfs: std::sync::atomic::AtomicBool,
}

/// What an upload of a home knows from before: its file index (hashing
/// only what changed) and the tree it was last saved as, if known.
struct HomeIndex<'a> {
    path: PathBuf,
    home: &'a str,
    unchanged_from: Option<Digest>,
}

/// An upload's bytes still to send (for the record's `save.bytes_pending`)
/// and the `runner:save_mid_upload` failpoint, fired once some of the
/// upload is done (the first object sent).
struct UploadProgress {
    pending: Arc<AtomicU64>,
    failpoint: Failpoints,
}

impl store::progress::Progress for UploadProgress {
    fn phase(&self, name: &'static str, total_bytes: Option<u64>) {
        if name == "uploading" {
            self.pending
                .store(total_bytes.unwrap_or(0), Ordering::Relaxed);
        }
    }

    fn advance(&self, bytes: u64) {
        let _ = self
            .pending
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| {
                Some(p.saturating_sub(bytes))
            });
        self.failpoint.hit("runner:save_mid_upload");
    }
}

/// A kept copy as the server is told of it.
pub(crate) struct KeptFacts {
    pub bytes: u64,
    pub kept_at_ms: i64,
    pub secured_root: Option<String>,
}

/// The bytes of the regular files under `root` (never following links).
fn tree_bytes(root: &Path) -> Result<u64> {
    let mut total = 0_u64;
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| Error::io("list", &dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
            let metadata = std::fs::symlink_metadata(entry.path())
                .map_err(|e| Error::io("inspect", entry.path(), e))?;
            if metadata.is_dir() {
                pending.push(entry.path());
            } else if metadata.is_file() {
                total = total.saturating_add(metadata.len());
            }
        }
    }
    Ok(total)
}

/// How often a save under way tells the server how much is left.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

fn ms_since_epoch(time: SystemTime) -> i64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Runs blocking work (tools, hashing, uploads) off the async threads.
async fn blocking<T: Send + 'static>(
    what: &'static str,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|join| Error::Invalid(format!("{what} failed: {join}")))?
}

impl Homes {
    /// `image_bytes`: the size of the btrfs image made for the homes when
    /// the data dir is not on btrfs (sparse: it costs what homes use);
    /// `None` (unit tests): no image, plain directories off btrfs.
    pub(crate) fn open(
        data_root: &Path,
        image_bytes: Option<u64>,
        failpoint: Failpoints,
    ) -> Result<Homes> {
        let image = data_root.join("homes.btrfs");
        let volumes = HomeVolumes::open(
            &data_root.join("volumes"),
            image_bytes.map(|_| image.as_path()),
            image_bytes.unwrap_or(0),
        )?;
        let state = data_root.join("home-state");
        let cache = data_root.join("block-cache");
        for dir in [&state, &cache] {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
        }
        let excludes = Excludes::from_env()
            .map_err(|e| Error::Invalid(format!("ROOST_HOME_EXCLUDES: {e}")))?;
        tracing::info!(backing = %volumes.backing(), "homes ready");
        if let Some(reason) = volumes.unbounded_because() {
            tracing::info!(%reason, "homes cannot be bounded here: `resources.home_mib` is not offered");
        }
        if let oci::volumes::Backing::LoopImage {
            buffered_because: Some(reason),
            ..
        } = volumes.backing()
        {
            tracing::warn!(%reason, "the homes' loop device is buffered: every home write is cached and written back twice");
        }
        Ok(Homes {
            volumes,
            legacy: data_root.join("homes"),
            state,
            cache,
            excludes,
            failpoint,
            saved_roots: Default::default(),
            #[cfg(test)]
            durable_without_btrfs: Default::default(),
        })
    }

    fn saved_roots(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Digest>> {
        self.saved_roots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers that the home of `id` is `root` (restored, or saved).
    fn saved_as(&self, id: &str, root: Option<Digest>) {
        let mut roots = self.saved_roots();
        match root {
            Some(root) => roots.insert(id.to_owned(), root),
            None => roots.remove(id),
        };
    }

    /// Whether running homes can be saved crash-consistently here (what
    /// `storage:durable` promises).
    pub(crate) fn can_snapshot(&self) -> bool {
        #[cfg(test)]
        if self.durable_without_btrfs.load(Ordering::Relaxed) {
            return true;
        }
        self.volumes.can_snapshot()
    }

    /// Whether a home can be bounded here (what `home:bounded` promises).
    pub(crate) fn can_bound(&self) -> bool {
        self.volumes.unbounded_because().is_none()
    }

    /// Where sandboxes' writable layers go (`volumes/roots`), where the
    /// homes' volume can hold them (btrfs).
    pub(crate) fn layers(&self) -> Option<PathBuf> {
        self.volumes
            .can_snapshot()
            .then(|| self.volumes.root().join("roots"))
    }

    /// Why sandboxes' writable layers cannot be bounded here (`None`:
    /// they can).
    pub(crate) fn layers_unbounded_because(&self) -> Option<&str> {
        self.volumes.unbounded_because()
    }

    /// Makes the writable layer of `id` (`volumes/roots/ID`, a subvolume)
    /// before a launch and bounds it to `bytes` where quota groups are on
    /// (else it is unbounded: the runner said why when it started). The
    /// bound is set at every launch, so a runner restarted with another
    /// applies it as sandboxes launch again.
    /// A layer already at `layer` whose bound cannot be set (quota groups
    /// turned off since the runner started, the `btrfs` tool gone) is
    /// used unbounded, with a warning: the bound is the runner's policy,
    /// not something the sandbox asked for.
    pub(crate) fn prepare_layer(&self, id: &str, layer: &Path, bytes: Option<u64>) -> Result<()> {
        let bytes = bytes.filter(|_| self.volumes.unbounded_because().is_none());
        match self.volumes.create_layer(id, bytes) {
            Ok(_) => Ok(()),
            Err(err) if layer.is_dir() => {
                tracing::warn!(sandbox_id = id, %err, "the sandbox's root layer is unbounded: its bound could not be set");
                Ok(())
            }
            Err(err) => Err(err),
        }
    }

    pub(crate) fn path(&self, id: &str) -> Result<PathBuf> {
        let legacy = self.legacy.join(id);
        if legacy.is_dir() {
            return Ok(legacy);
        }
        self.volumes.home(id)
    }

    fn index_path(&self, id: &str) -> PathBuf {
        self.state.join(format!("{id}.index"))
    }

    fn secured_path(&self, id: &str) -> PathBuf {
        self.state.join(format!("{id}.secured"))
    }

    fn restoring_path(&self, id: &str) -> PathBuf {
        self.state.join(format!("{id}.restoring"))
    }

    /// Whether the home here is a restore of a stored tree that has not
    /// finished (the store went away mid-wake): nothing ran in it, it holds
    /// no work, and it is not the sandbox's home as saved (a part of it at
    /// most), so it is never uploaded as a save or a snapshot.
    pub(crate) fn restore_unfinished(&self, id: &str) -> bool {
        self.restoring_path(id).exists()
    }

    /// Whether this runner holds a home for the sandbox at all: a
    /// placement stopped before its launch made one holds none.
    pub(crate) fn holds(&self, id: &str) -> bool {
        self.path(id).is_ok_and(|home| home.is_dir())
    }

    fn securing_path(&self, id: &str) -> PathBuf {
        self.state.join(format!("{id}.securing"))
    }

    fn org(org: &str) -> Result<OrgId> {
        org.parse()
            .map_err(|_| Error::Invalid(format!("org {org:?} is not a store org")))
    }

    /// Makes the home ready for a launch: created if missing, and made the
    /// tree `root` (the last completed save, or a snapshot) unless it is
    /// that tree already (secured here by the last stop) or this placement
    /// ran on it before. Only what differs
    /// is written, and only blocks missing from the cache come down.
    /// For a durable home, also what the wake downloaded.
    /// A store out of reach or full is [`NotReady::Store`]: what the home
    /// became so far stays, marked as a restore under way, and the next
    /// attempt finishes it (writing only what differs).
    /// `last_launched`: the epoch of the placement a container was last
    /// launched for here (`DIR/sandboxes/ID/placement`), if known.
    ///
    /// The home is bounded (`resources.home_mib`) once it is that tree, so
    /// a restore is never cut short by the bound: a home restored larger
    /// keeps its files and takes no new writes until it shrinks.
    pub(crate) async fn prepare(
        &self,
        control: &Arc<dyn ControlPlane>,
        sandbox: &SandboxAssignment,
        last_launched: Option<u64>,
    ) -> std::result::Result<(PathBuf, Option<WakeReport>), NotReady> {
        // A home bounded by an earlier launch is unbounded while it is
        // made the record's tree again (a restore writes each changed file
        // beside the old one), then bounded again below.
        let bounded_before = sandbox.resources.home_mib.is_some()
            && self.volumes.home(&sandbox.sandbox_id)?.is_dir();
        if bounded_before {
            self.volumes.bound(&sandbox.sandbox_id, None)?;
        }
        let prepared = self.prepare_tree(control, sandbox, last_launched).await?;
        if let Some(mib) = sandbox.resources.home_mib {
            let id = sandbox.sandbox_id.clone();
            // A legacy home (a plain directory from before btrfs) cannot
            // be bounded: `bound` refuses it, and the launch with it.
            if prepared.0 != self.volumes.home(&id)? {
                return Err(Error::Unsupported(format!(
                    "the home of {id} is a plain directory from before btrfs and cannot be bounded"
                ))
                .into());
            }
            // One short tool run, as the home's `create` above.
            self.volumes.bound(&id, Some(mib.saturating_mul(1 << 20)))?;
        }
        Ok(prepared)
    }

    async fn prepare_tree(
        &self,
        control: &Arc<dyn ControlPlane>,
        sandbox: &SandboxAssignment,
        last_launched: Option<u64>,
    ) -> std::result::Result<(PathBuf, Option<WakeReport>), NotReady> {
        let id = sandbox.sandbox_id.clone();
        let (home, existed) = match self.path(&id) {
            Ok(home) if home.is_dir() => (home, true),
            _ => (self.volumes.create(&id)?, false),
        };
        let restoring = self.restoring_path(&id);
        // A standard home starts as `root` (a snapshot) once; after that it
        // is its own, kept on this runner. Unless that first restore never
        // finished: then it is finished now.
        if sandbox.storage_class != StorageClass::Durable && existed && !restoring.exists() {
            return Ok((home, None));
        }
        let secured = self.secured_path(&id);
        let secured_root = std::fs::read_to_string(&secured).unwrap_or_default();
        let woke = |downloaded_bytes: u64| {
            (sandbox.storage_class == StorageClass::Durable).then_some(WakeReport {
                downloaded_bytes,
                from_own_copy: existed,
            })
        };
        // This placement ran on this home already (started again while its
        // stop had not secured it, or launched again after a failed
        // attempt): the home holds its work, newer than any completed save
        // (saves of this epoch are snapshots of it). It runs on as it is;
        // the record's root would undo everything since the last save.
        if existed && !restoring.exists() && last_launched == Some(sandbox.epoch) {
            let _ = std::fs::remove_file(&secured);
            let _ = std::fs::remove_file(self.securing_path(&id));
            return Ok((home, woke(0)));
        }
        let mut home = home;
        // Any other home here that no stop secured (an earlier placement's:
        // this runner was lost while the sandbox ran or secured; or one
        // whose placement is not recorded) may hold writes no completed
        // save has, whatever the record's state. It is kept aside (and
        // reported with the other kept copies) before it is made the
        // record's tree, never written over. Not a restore this runner
        // left unfinished: nothing ever ran in that.
        if existed && secured_root.trim().is_empty() && !restoring.exists() {
            if let Some(name) = self.keep_aside(&id)? {
                tracing::warn!(sandbox_id = %id, copy = %name, "a home this runner held from an earlier placement is kept aside before the home is restored");
            }
            if sandbox.home_root.is_none() {
                // The record says the home starts empty: so it does.
                self.volumes.remove(&id)?;
            }
            home = self.volumes.create(&id)?;
        }
        // From here the home runs or is made another tree: a securing's
        // root no longer names it.
        let _ = std::fs::remove_file(self.securing_path(&id));
        let Some(root) = sandbox.home_root.clone() else {
            if restoring.exists() {
                // Part of a tree the record no longer names: it starts empty.
                self.volumes.remove(&id)?;
                home = self.volumes.create(&id)?;
                let _ = std::fs::remove_file(&restoring);
            }
            let _ = std::fs::remove_file(&secured);
            self.saved_as(&id, None);
            return Ok((home, None));
        };
        let digest: Digest = root
            .parse()
            .map_err(|_| Error::Invalid(format!("home root {root:?} is not a digest")))?;
        if secured_root.trim() == root {
            // About to run again: from here on the home may differ.
            let _ = std::fs::remove_file(&secured);
            self.saved_as(&id, Some(digest));
            return Ok((home, woke(0)));
        }
        let org = Self::org(&sandbox.org_id)?;
        let store = control.blocks();
        let options = PullOptions {
            // Read, not filled: the home itself is this runner's copy.
            cache: Some(self.cache.clone()),
            fill_cache: false,
            index_path: Some(self.index_path(&id)),
            store_id: "control-plane".to_owned(),
            index_dev: Some(INDEX_DEV),
            check_room: true,
            // The homes' loop-mounted image is sparse: the data dir's
            // file system (the block cache's) must hold the bytes too.
            room_also: Some(self.cache.clone()),
        };
        // Marked before the first byte is written, so that whatever stops
        // this restore half-way leaves a home known to hold no work.
        oci::host::write_durably(&restoring, root.as_bytes())?;
        let dest = home.clone();
        let started = Instant::now();
        let pulled = tokio::task::spawn_blocking(move || {
            materialize(
                &store,
                &org,
                "home",
                &digest,
                &dest,
                &options,
                &store::progress::NoProgress,
            )
        })
        .await
        .map_err(|join| Error::Invalid(format!("materialising the home failed: {join}")))?;
        let report = match pulled {
            Ok(report) => report,
            Err(err) => {
                return Err(NotReady::of_pull(&err, "the home", &digest, &home));
            }
        };
        let _ = std::fs::remove_file(&secured);
        // From here on the home may take work: the mark must be gone, on
        // disk too, before the workload starts, or a later placement here
        // would take the work for a restore and write over it.
        match std::fs::remove_file(&restoring) {
            Ok(()) => oci::host::sync_dir(&self.state)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &restoring, e).into()),
        }
        self.saved_as(&id, Some(digest));
        tracing::info!(
            sandbox_id = %id,
            root = %digest,
            files_written = report.files_written,
            files_unchanged = report.files_unchanged,
            blocks_downloaded = report.blocks_downloaded,
            blocks_from_cache = report.blocks_from_cache,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "home materialised"
        );
        Ok((home, woke(report.bytes_downloaded)))
    }

    /// Uploads `dir` (a snapshot of the home, or the home of a stopped
    /// sandbox) as the home's tree, observed at `observed_at`.
    async fn upload(
        &self,
        control: &Arc<dyn ControlPlane>,
        sandbox: &SandboxAssignment,
        runner_id: &str,
        dir: PathBuf,
        observed_at: SystemTime,
        unchanged_from: Option<Digest>,
    ) -> Result<PushReport> {
        let (org, id) = (sandbox.org_id.as_str(), sandbox.sandbox_id.as_str());
        let pending = Arc::new(AtomicU64::new(0));
        let progress = UploadProgress {
            pending: pending.clone(),
            failpoint: self.failpoint.clone(),
        };
        // Tells the server the bytes to go while the upload runs (durable
        // homes only: what `save.bytes_pending` shows).
        let reporter = (sandbox.storage_class == StorageClass::Durable).then(|| {
            let (control, mut report) = (
                control.clone(),
                SaveReport {
                    runner_id: runner_id.to_owned(),
                    epoch: sandbox.epoch,
                    outcome: "progress".to_owned(),
                    root: None,
                    captured_at_ms: None,
                    bytes_pending: None,
                    error: None,
                    snapshot_ms: None,
                    uploaded_bytes: None,
                    securing: false,
                },
            );
            let id = id.to_owned();
            tokio::spawn(async move {
                let mut last = 0;
                loop {
                    tokio::time::sleep(PROGRESS_EVERY).await;
                    let now = pending.load(Ordering::Relaxed);
                    if now != last {
                        report.bytes_pending = Some(now);
                        let _ = control.runner_report_save(&id, &report).await;
                        last = now;
                    }
                }
            })
        });
        let uploaded = self
            .upload_dir(
                control,
                org,
                dir,
                Some(HomeIndex {
                    path: self.index_path(id),
                    home: id,
                    unchanged_from,
                }),
                observed_at,
                progress,
            )
            .await;
        if let Some(reporter) = reporter {
            reporter.abort();
        }
        uploaded
    }

    /// Uploads `dir` as a tree of `org` through the block service (the
    /// objects only: the server commits or pins the root), hashing only
    /// what changed since `index_path`'s index, if any.
    async fn upload_dir(
        &self,
        control: &Arc<dyn ControlPlane>,
        org: &str,
        dir: PathBuf,
        index: Option<HomeIndex<'_>>,
        observed_at: SystemTime,
        progress: UploadProgress,
    ) -> Result<PushReport> {
        let org = Self::org(org)?;
        let store = control.blocks();
        let index_path = index.as_ref().map(|index| index.path.clone());
        // A scan that finds the home exactly as this root uploads nothing
        // and says so (`PushReport::unchanged`).
        let since = match index.and_then(|index| Some((index.home, index.unchanged_from?))) {
            Some((id, root)) => Some(Since {
                store_id: "control-plane".to_owned(),
                home: id
                    .parse()
                    .map_err(|_| Error::Invalid(format!("sandbox id {id:?} is not a home name")))?,
                root: Some(root),
            }),
            None => None,
        };
        let options = UploadOptions {
            excludes: self.excludes.clone(),
            index_path,
            key_rule: KeyRule {
                dev: Some(INDEX_DEV),
                observed_at_ns: Some(ms_since_epoch(observed_at).saturating_mul(1_000_000)),
            },
            since,
        };
        blocking("uploading the home", move || {
            let uploaded = upload_tree(&store, &org, &dir, &options, &progress);
            uploaded.and_then(Upload::finish).map_err(|e| match e {
                store::Error::Backend { .. } => Error::io(
                    "upload the home from",
                    &dir,
                    std::io::Error::other(e.to_string()),
                ),
                // Full, as this runner's own disk out of space is: what
                // `SaveFailure` tells apart.
                store::Error::StoreFull { .. } => Error::io(
                    "upload the home from",
                    &dir,
                    std::io::Error::new(std::io::ErrorKind::StorageFull, e.to_string()),
                ),
                _ => Error::Unusable(format!(
                    "cannot upload the home from {}: {e}",
                    dir.display()
                )),
            })
        })
        .await
    }

    /// Asks the server to commit `root` as the home's last completed save.
    /// `snapshot`: how long a running home's snapshot took (none when
    /// securing a stopped one, which the report then says it is);
    /// `uploaded_bytes`: what the upload stored.
    async fn commit(
        control: &Arc<dyn ControlPlane>,
        sandbox: &SandboxAssignment,
        runner_id: &str,
        root: Digest,
        captured_at: SystemTime,
        snapshot: Option<Duration>,
        uploaded_bytes: u64,
    ) -> Result<(), SaveFailure> {
        let report = SaveReport {
            runner_id: runner_id.to_owned(),
            epoch: sandbox.epoch,
            outcome: "completed".to_owned(),
            root: Some(root.to_hex()),
            captured_at_ms: Some(ms_since_epoch(captured_at)),
            bytes_pending: None,
            error: None,
            snapshot_ms: snapshot.map(|took| took.as_secs_f64() * 1000.0),
            uploaded_bytes: Some(uploaded_bytes),
            // No snapshot: the home of a stopped sandbox, secured.
            securing: snapshot.is_none(),
        };
        match control
            .runner_report_save(&sandbox.sandbox_id, &report)
            .await
        {
            Ok(_) => Ok(()),
            Err(err) => match refusal(err) {
                Err(Refusal::Fenced(message)) => Err(SaveFailure::Fenced(message)),
                Err(Refusal::Refused(err)) | Ok(err) => Err(SaveFailure::Failed(format!(
                    "the server did not commit the save: {err}"
                ))),
            },
        }
    }

    /// Tells the server a scheduled save found the home exactly as `root`,
    /// its last completed save. False when the server's last completed
    /// save is another root (the caller commits this one instead).
    async fn report_unchanged(
        control: &Arc<dyn ControlPlane>,
        sandbox: &SandboxAssignment,
        runner_id: &str,
        root: Digest,
        captured_at: SystemTime,
    ) -> Result<bool, SaveFailure> {
        let report = SaveReport {
            runner_id: runner_id.to_owned(),
            epoch: sandbox.epoch,
            outcome: "unchanged".to_owned(),
            root: Some(root.to_hex()),
            captured_at_ms: Some(ms_since_epoch(captured_at)),
            bytes_pending: None,
            error: None,
            snapshot_ms: None,
            uploaded_bytes: Some(0),
            securing: false,
        };
        match control
            .runner_report_save(&sandbox.sandbox_id, &report)
            .await
        {
            Ok(_) => Ok(true),
            Err(err) => match refusal(err) {
                Err(Refusal::Fenced(message)) => Err(SaveFailure::Fenced(message)),
                Err(Refusal::Refused(_)) => Ok(false),
                Ok(err) => Err(SaveFailure::Failed(format!(
                    "the server did not take the save: {err}"
                ))),
            },
        }
    }

    /// Tells the server a save failed (kept on the record as `save.state`
    /// `failing`); a fenced answer says to stop.
    pub(crate) async fn report_failure(
        control: &Arc<dyn ControlPlane>,
        sandbox: &SandboxAssignment,
        runner_id: &str,
        error: &str,
    ) -> Result<(), SaveFailure> {
        let report = SaveReport {
            runner_id: runner_id.to_owned(),
            epoch: sandbox.epoch,
            outcome: "failed".to_owned(),
            root: None,
            captured_at_ms: None,
            bytes_pending: None,
            error: Some(error.to_owned()),
            snapshot_ms: None,
            uploaded_bytes: None,
            securing: false,
        };
        match control
            .runner_report_save(&sandbox.sandbox_id, &report)
            .await
        {
            Err(err) => match refusal(err) {
                Err(Refusal::Fenced(message)) => Err(SaveFailure::Fenced(message)),
                _ => Ok(()),
            },
            Ok(_) => Ok(()),
        }
    }

    /// A save of a running home: snapshot, upload, commit. Returns how long
    /// the snapshot took (the pause the workload may have felt).
    pub(crate) async fn save_running(
        &self,
        control: &Arc<dyn ControlPlane>,
        sandbox: &SandboxAssignment,
        runner_id: &str,
    ) -> Result<Duration, SaveFailure> {
        let id = sandbox.sandbox_id.clone();
        self.drop_save_snapshots(&id);
        let name = format!(
            "{SAVE_SNAPSHOT_PREFIX}{}-{}",
            sandbox.epoch,
            ms_since_epoch(SystemTime::now())
        );
        // Flush the home's dirty data first, while the workload runs on:
        // the snapshot then has little left to flush, and the pause it can
        // cause (btrfs holds writers while it commits) stays short.
        if let Ok(home) = self.path(&id)
            && let Ok(dir) = std::fs::File::open(&home)
        {
            let _ = rustix::fs::syncfs(&dir);
        }
        let captured_at = SystemTime::now();
        let snapshot = self.volumes.snapshot(&id, &name)?;
        self.failpoint.hit("runner:save_before_upload");
        let result = async {
            let last = self.saved_roots().get(&id).copied();
            let report = self
                .upload(
                    control,
                    sandbox,
                    runner_id,
                    snapshot.path.clone(),
                    captured_at,
                    last,
                )
                .await?;
            let root = report
                .root
                .ok_or_else(|| Error::Invalid("the upload gave no root".to_owned()))?;
            if report.unchanged && Some(root) == last {
                // Parked: nothing changed since the last completed save.
                // The server records when that was found (`safe_until`
                // moves on, `last_completed_at` does not); should it not
                // take it (its root is another), a whole commit follows.
                if Self::report_unchanged(control, sandbox, runner_id, root, captured_at).await? {
                    tracing::debug!(sandbox_id = %id, %root, "home unchanged since its last save");
                    return Ok(());
                }
            }
            self.failpoint.hit("runner:save_before_commit");
            Self::commit(
                control,
                sandbox,
                runner_id,
                root,
                captured_at,
                Some(snapshot.took),
                report.bytes_uploaded,
            )
            .await?;
            self.failpoint.hit("runner:save_after_commit");
            self.saved_as(&id, Some(root));
            tracing::info!(
                sandbox_id = %id,
                %root,
                snapshot_ms = snapshot.took.as_secs_f64() * 1000.0,
                files_hashed = report.files_hashed,
                blocks_uploaded = report.blocks_uploaded,
                bytes_uploaded = report.bytes_uploaded,
                "home saved"
            );
            Ok::<_, SaveFailure>(())
        }
        .await;
        if let Err(err) = self.volumes.delete_snapshot(&id, &name) {
            tracing::warn!(sandbox_id = %id, %err, "cannot delete a save's snapshot");
        }
        result.map(|()| snapshot.took)
    }

    /// Secures the home of a stopped sandbox: uploads it as it is (nothing
    /// runs in it) and commits it; remembers the root so that a start here
    /// pulls nothing.
    pub(crate) async fn secure(
        &self,
        control: &Arc<dyn ControlPlane>,
        sandbox: &SandboxAssignment,
        runner_id: &str,
    ) -> Result<(), SaveFailure> {
        let id = sandbox.sandbox_id.clone();
        // An interrupted save's snapshots go; a snapshot being captured
        // for `snapshot` stays: its task reads it.
        self.drop_save_snapshots(&id);
        let home = self.path(&id)?;
        if !home.is_dir() {
            return Err(SaveFailure::Failed(format!(
                "the home {} is missing on this runner",
                home.display()
            )));
        }
        self.failpoint.hit("runner:secure_before_upload");
        let captured_at = SystemTime::now();
        // A home unchanged since its last save uploads nothing; it is
        // committed all the same (the stop's securing must say so).
        let last = self.saved_roots().get(&id).copied();
        let report = self
            .upload(control, sandbox, runner_id, home, captured_at, last)
            .await?;
        let root = report
            .root
            .ok_or_else(|| SaveFailure::Failed("the upload gave no root".to_owned()))?;
        // Should this runner die between here and recording the root as
        // secured, the copy it keeps aside then names this tree: the
        // server knows whether it committed it (a copy of the last
        // completed save may go once the sandbox runs from the store).
        let securing = self.securing_path(&id);
        oci::host::write_durably(&securing, root.to_hex().as_bytes())?;
        self.failpoint.hit("runner:secure_before_commit");
        Self::commit(
            control,
            sandbox,
            runner_id,
            root,
            captured_at,
            None,
            report.bytes_uploaded,
        )
        .await?;
        self.failpoint.hit("runner:secure_after_commit");
        let secured = self.secured_path(&id);
        std::fs::write(&secured, root.to_hex()).map_err(|e| Error::io("write", &secured, e))?;
        let _ = std::fs::remove_file(&securing);
        tracing::info!(sandbox_id = %id, %root, files_hashed = report.files_hashed, blocks_uploaded = report.blocks_uploaded, "home secured");
        Ok(())
    }

    /// Captures the home for the snapshot `snapshot_id` (a read-only
    /// snapshot while it runs, the home itself when it does not), reports
    /// it `local`, uploads it and reports it `replicated` with its root.
    pub(crate) async fn snapshot(
        &self,
        control: &Arc<dyn ControlPlane>,
        sandbox: &SandboxAssignment,
        runner_id: &str,
        snapshot_id: &str,
        running: bool,
    ) -> std::result::Result<(), SaveFailure> {
        let id = sandbox.sandbox_id.clone();
        let report = |durability: &str,
                      root: Option<(Digest, u64)>,
                      at: Option<SystemTime>,
                      message: Option<String>| SnapshotReport {
            runner_id: runner_id.to_owned(),
            epoch: sandbox.epoch,
            durability: durability.to_owned(),
            root: root.map(|(r, _)| r.to_hex()),
            files: root.map(|(_, files)| files),
            captured_at_ms: at.map(ms_since_epoch),
            message,
        };
        let send = |report: SnapshotReport| async move {
            match control.runner_report_snapshot(snapshot_id, &report).await {
                Ok(_) => Ok(()),
                Err(err) => match refusal(err) {
                    Err(Refusal::Fenced(message)) => Err(SaveFailure::Fenced(message)),
                    Err(Refusal::Refused(err)) | Ok(err) => Err(SaveFailure::Failed(format!(
                        "snapshot report refused: {err}"
                    ))),
                },
            }
        };
        let captured_at = SystemTime::now();
        let name = capture_name(snapshot_id);
        if !running && self.restore_unfinished(&id) {
            let message = "the home on this runner is an unfinished restore (the store was out of reach): it is not the sandbox's home as saved".to_owned();
            send(report("failed", None, None, Some(message.clone()))).await?;
            return Err(SaveFailure::Failed(message));
        }
        let (dir, taken) = if running {
            if !self.volumes.can_snapshot() {
                let message = "this runner cannot capture a running home (no btrfs)".to_owned();
                send(report("failed", None, None, Some(message.clone()))).await?;
                return Err(SaveFailure::Failed(message));
            }
            // A capture left by an attempt of this snapshot that did not
            // finish (a runner killed mid-way): one task per snapshot runs
            // at a time, so nothing reads it any more.
            if self.volumes.snapshots(&id)?.contains(&name) {
                self.volumes.delete_snapshot(&id, &name)?;
            }
            let snap = self.volumes.snapshot(&id, &name)?;
            (snap.path, true)
        } else {
            (self.path(&id)?, false)
        };
        let result = async {
            send(report("local", None, Some(captured_at), None)).await?;
            let uploaded = self
                .upload(control, sandbox, runner_id, dir.clone(), captured_at, None)
                .await?;
            let root = uploaded
                .root
                .ok_or_else(|| SaveFailure::Failed("the upload gave no root".to_owned()))?;
            send(report(
                "replicated",
                Some((root, uploaded.files)),
                Some(captured_at),
                None,
            ))
            .await?;
            tracing::info!(sandbox_id = %id, snapshot_id, %root, "snapshot replicated");
            Ok(())
        }
        .await;
        if taken && let Err(err) = self.volumes.delete_snapshot(&id, &name) {
            tracing::warn!(sandbox_id = %id, %err, "cannot delete a snapshot's capture");
        }
        result
    }

    fn kept_state_path(&self, id: &str, name: &str) -> PathBuf {
        self.state.join(format!("{id}.kept.{name}"))
    }

    /// Sets the home of `id` aside as a kept copy (see `kept`), named after
    /// now, with the root a stop secured if it is exactly that tree.
    /// `None`: there is no home. The home itself is left for the caller to
    /// remove or write over.
    pub(crate) fn keep_aside(&self, id: &str) -> Result<Option<String>> {
        let legacy = self.legacy.join(id);
        if legacy.is_dir() {
            return Err(Error::Unsupported(format!(
                "the home {} is of the earlier layout and cannot be kept aside: it stays where it is",
                legacy.display()
            )));
        }
        let home = self.volumes.home(id)?;
        // A restore under way holds nothing a workload wrote: it is the
        // store's tree, or part of it.
        if !home.is_dir() || self.restoring_path(id).exists() {
            return Ok(None);
        }
        let name = format!("k{}", ms_since_epoch(SystemTime::now()));
        // The root a stop secured, else the one a securing cut short had
        // uploaded (committed or not: the server compares).
        let mut secured = std::fs::read_to_string(self.secured_path(id)).unwrap_or_default();
        if secured.trim().is_empty() {
            secured = std::fs::read_to_string(self.securing_path(id)).unwrap_or_default();
        }
        let state = self.kept_state_path(id, &name);
        oci::host::write_durably(&state, secured.trim().as_bytes())?;
        self.volumes.keep(id, &name)?;
        Ok(Some(name))
    }

    /// Every kept copy on this runner, as (sandbox id, name).
    pub(crate) fn kept_copies(&self) -> Result<Vec<(String, String)>> {
        self.volumes.kept()
    }

    /// What the server is told of a kept copy: its size, when it was set
    /// aside (its name) and its secured root, if any.
    pub(crate) fn kept_facts(&self, id: &str, name: &str) -> Result<KeptFacts> {
        let path = self.volumes.kept_path(id, name)?;
        let kept_at_ms = name
            .strip_prefix('k')
            .and_then(|ms| ms.parse().ok())
            .unwrap_or_else(|| ms_since_epoch(SystemTime::now()));
        let secured = std::fs::read_to_string(self.kept_state_path(id, name)).unwrap_or_default();
        let secured = secured.trim();
        Ok(KeptFacts {
            bytes: tree_bytes(&path)?,
            kept_at_ms,
            secured_root: (!secured.is_empty()).then(|| secured.to_owned()),
        })
    }

    /// Uploads the kept copy `name` of sandbox `id` (read as it is: it is
    /// read-only and nothing runs in it) as a tree of `org`, for a
    /// salvage; the copy stays. No index: the home's describes another
    /// tree, so every file is hashed.
    pub(crate) async fn upload_kept(
        &self,
        control: &Arc<dyn ControlPlane>,
        org: &str,
        id: &str,
        name: &str,
    ) -> Result<PushReport> {
        let dir = self.volumes.kept_path(id, name)?;
        if !dir.is_dir() {
            return Err(Error::Invalid(format!(
                "the kept copy {name} of {id} is not on this runner (no {})",
                dir.display()
            )));
        }
        let progress = UploadProgress {
            pending: Arc::new(AtomicU64::new(0)),
            failpoint: Failpoints::none(),
        };
        self.upload_dir(control, org, dir, None, SystemTime::now(), progress)
            .await
    }

    /// Deletes a kept copy (the server said it may go).
    pub(crate) fn discard_kept(&self, id: &str, name: &str) -> Result<()> {
        self.volumes.discard_kept(id, name)?;
        let state = self.kept_state_path(id, name);
        match std::fs::remove_file(&state) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &state, e)),
        }
    }

    /// Removes the snapshots of earlier saves of `id` that the runner died
    /// (or the save was aborted) before deleting: only its own save reads a
    /// save's snapshot, and a sandbox's saves run one at a time. Left, each
    /// would hold the home's old data on this runner for as long as the
    /// sandbox runs here. Snapshots being captured for `snapshot` stay.
    fn drop_save_snapshots(&self, id: &str) {
        if let Ok(names) = self.volumes.snapshots(id) {
            for name in names.iter().filter(|n| n.starts_with(SAVE_SNAPSHOT_PREFIX)) {
                if let Err(err) = self.volumes.delete_snapshot(id, name) {
                    tracing::warn!(sandbox_id = %id, snapshot = %name, %err, "cannot delete an earlier save's snapshot");
                }
            }
        }
    }

    /// Removes the read-only capture an attempt of snapshot `snapshot_id`
    /// took of the home, if any: its task was stopped (the snapshot is
    /// no longer assigned) before it could remove it itself.
    pub(crate) fn drop_capture(&self, id: &str, snapshot_id: &str) {
        let name = capture_name(snapshot_id);
        if self
            .volumes
            .snapshots(id)
            .is_ok_and(|names| names.contains(&name))
            && let Err(err) = self.volumes.delete_snapshot(id, &name)
        {
            tracing::warn!(sandbox_id = %id, snapshot_id, %err, "cannot delete a stopped snapshot's capture");
        }
    }

    /// Removes the home, its snapshots and its state.
    pub(crate) fn remove(&self, id: &str) -> Result<()> {
        let legacy = self.legacy.join(id);
        if legacy.exists() {
            super::dirs::remove_tree(&legacy)?;
        }
        self.volumes.remove(id)?;
        for path in [
            self.index_path(id),
            self.secured_path(id),
            self.restoring_path(id),
            self.securing_path(id),
        ] {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("remove", &path, e)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io_error(errno: rustix::io::Errno) -> store::Error {
        store::Error::Io {
            path: PathBuf::from("usr/lib/libbig.so"),
            source: errno.into(),
        }
    }

    /// Regression (audit): a pull that found this runner's own disk full
    /// (`ENOSPC`, `EDQUOT`) was taken for a full store: the launch waited
    /// `store_full` and retried for ever, an image pull filling the disk
    /// again each time. It fails the launch, naming the local disk; the
    /// store saying it is full (the block service's 507) still waits.
    #[test]
    fn regression_a_full_local_disk_is_not_a_full_store() {
        let dest = Path::new("/data/images/.tmp-abc-0");
        let root = store::Digest::of(b"an image");
        for errno in [rustix::io::Errno::NOSPC, rustix::io::Errno::DQUOT] {
            let err = io_error(errno);
            assert_eq!(StoreWait::of(&err, "the image"), None, "{errno:?}");
            match NotReady::of_pull(&err, "the image", &root, dest) {
                NotReady::DiskFull(message) => {
                    let expected = format!(
                        "no space left on this runner's disk for the image {root} (writing {}): ",
                        dest.display()
                    );
                    assert!(message.starts_with(&expected), "{message}");
                    assert!(message.contains("usr/lib/libbig.so"), "{message}");
                }
                other => panic!("{errno:?} is not a full disk: {other:?}"),
            }
        }
        let full = store::Error::StoreFull {
            op: "get",
            key: "orgs/acme/blocks/abc".to_owned(),
            message: "insufficient storage".to_owned(),
        };
        match NotReady::of_pull(&full, "the image", &root, dest) {
            NotReady::Store(wait) => assert_eq!(wait.reason, "store_full"),
            other => panic!("a full store fails the launch: {other:?}"),
        }
        let unreachable = store::Error::Backend {
            op: "get",
            key: "orgs/acme/blocks/abc".to_owned(),
            message: "connection refused".to_owned(),
        };
        assert_eq!(
            StoreWait::of(&unreachable, "the home").map(|wait| wait.reason),
            Some("store_unreachable")
        );
        // Anything else about the pull fails it as before.
        let missing = store::Error::MissingObject {
            digest: store::Digest::of(b"gone"),
            path: None,
        };
        match NotReady::of_pull(&missing, "the home", &root, dest) {
            NotReady::Failed(err) => {
                assert!(err.is_permanent());
                let expected = format!("cannot materialise the home {root}: object ");
                assert!(err.to_string().starts_with(&expected), "{err}");
            }
            other => panic!("a missing object is not a failure: {other:?}"),
        }
    }
}
