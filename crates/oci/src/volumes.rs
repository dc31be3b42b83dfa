//! Where sandbox homes (`/workspace`) live on a runner host, and how a
//! home is frozen at one instant so that it can be saved while the sandbox
//! keeps running.
//!
//! ```text
//! ROOT/homes/ID              the home of sandbox ID: a btrfs subvolume
//!                            (a plain directory when btrfs is unavailable)
//! ROOT/snapshots/ID/NAME     a read-only btrfs snapshot of that home
//! ROOT/kept/ID/NAME          a copy of the home kept aside: read-only,
//!                            never mounted (it may be the newest copy of
//!                            the work, so it is not deleted with the home)
//! ROOT/roots/ID              the writable layer of sandbox ID's root file
//!                            system (`oci::config::SandboxPaths::layer`):
//!                            a btrfs subvolume, so that it can be bounded
//!                            ([`HomeVolumes::create_layer`])
//! ```
//!
//! # Why snapshots
//!
//! A durable sandbox's home is saved (hashed, uploaded) while its workload
//! keeps writing to it. Reading the live directory would save a mix of
//! before and after: a half-written file next to the index that points
//! into it. A read-only snapshot of the home's subvolume is the home as a
//! power cut would have left it (crash-consistent: what the workload had
//! written, not what it still held in its own buffers), taken in
//! milliseconds whatever the home's size; the save then reads the snapshot
//! at leisure and deletes it. Snapshots live outside `homes/` so that the
//! home's bind mount into the sandbox never shows them, and in the same
//! filesystem, which btrfs requires.
//!
//! # Backings
//!
//! - [`Backing::Btrfs`]: `ROOT` is on btrfs already (a btrfs data disk).
//! - [`Backing::LoopImage`]: `ROOT` is elsewhere, so a sparse image file
//!   formatted btrfs is loop-mounted at `ROOT`. The mount outlives the
//!   runner process: a restarted runner finds it in `/proc/self/mountinfo`
//!   and uses it again instead of stacking a second mount over the first.
//! - [`Backing::Plain`]: no btrfs here (no btrfs-progs, no kernel support,
//!   no loop devices). Homes are plain directories and cannot be
//!   snapshotted; the reason is kept so the runner can report why it does
//!   not offer durable homes. That is not an error: the caller decides.
//!
//! # nosuid, nodev
//!
//! Homes hold tenant content the runner's host can see: a `chmod 4755` in
//! `/workspace` makes a setuid file owned by the sandbox's root, that is
//! the host's root. So every btrfs volume holding homes and snapshots is
//! mounted `nosuid,nodev` ([`HomeVolumes::open`]): an image this code
//! mounts gets the options at mount; a mount found already there (an
//! earlier runner's, a btrfs data disk) is remounted with them; a `ROOT`
//! that is a directory of a larger btrfs is bind-mounted on itself first,
//! so only it changes. Plain homes are not a mount of ours and rely on the
//! runner's data dir being `0700` (`runner::agent::dirs`), like the rest
//! of what the runner writes.
//!
//! # Host tools
//!
//! Subvolumes and snapshots are made with `btrfs` (the ioctls would need
//! `unsafe`), images with `mkfs.btrfs`, mounts with `mount -o loop` (which
//! also sets up the loop device and frees it at unmount), the loop device's
//! direct I/O with `losetup` ([`use_direct_io`]). Btrfs is detected
//! with `statfs(2)`, never by reading a tool's output. Every tool runs
//! through [`crate::host::run_tool`]. Everything here blocks: async code
//! calls it from `spawn_blocking`. One runner uses a
//! `ROOT` at a time (the data dir's lock sees to that).

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io::ErrorKind;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::host::{self, ToolFailureKind, find_binary, sync_dir, unescape_mountinfo};

/// `statfs(2)`'s `f_type` of a btrfs filesystem (`BTRFS_SUPER_MAGIC`).
pub const BTRFS_SUPER_MAGIC: u32 = 0x9123_683E;
/// The inode number of every subvolume's root directory
/// (`BTRFS_FIRST_FREE_OBJECTID`): how `btrfs` itself tells a subvolume from
/// a directory.
const SUBVOLUME_ROOT_INODE: u64 = 256;
/// Longest sandbox id or snapshot name: both become file names.
pub const NAME_BYTES_MAX: usize = 128;
/// Smallest image accepted: a btrfs with the default profiles needs about
/// 114 MiB, and a home volume smaller than this is useless anyway.
pub const IMAGE_BYTES_MIN: u64 = 128 << 20;
/// Options of every mount of ours that holds homes (see "nosuid, nodev").
const MOUNT_OPTIONS: &str = "loop,nosuid,nodev";
/// Searched for the tools when the process has no `PATH`.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Where sandbox homes live on a runner host and how they are snapshotted.
#[derive(Debug)]
pub struct HomeVolumes {
    /// Canonical (symlinks resolved), as `/proc/self/mountinfo` shows it.
    root: PathBuf,
    backing: Backing,
    /// The `btrfs` tool, found once at open; `None` with [`Backing::Plain`].
    btrfs: Option<PathBuf>,
    /// Why a home cannot be bounded ([`HomeVolumes::bound`]) here; `None`
    /// when btrfs quota groups are on and it can.
    unbounded_because: Option<String>,
}

/// What holds the homes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// `root` is on btrfs already: homes are subvolumes there.
    Btrfs,
    /// A sparse image file formatted btrfs, loop-mounted at `root`.
    LoopImage {
        /// The image file (canonical path).
        image: PathBuf,
        /// Why the loop device writes through the image file's page cache
        /// (buffered) instead of straight to the file (direct I/O, see
        /// [`use_direct_io`]); `None` when it is direct. Buffered is
        /// correct, only slower.
        buffered_because: Option<String>,
    },
    /// No btrfs available: plain directories, no snapshots.
    Plain {
        /// Why btrfs could not be used, for logs and the runner's
        /// capabilities.
        reason: String,
    },
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backing::Btrfs => f.write_str("btrfs"),
            Backing::LoopImage {
                image,
                buffered_because: None,
            } => write!(f, "btrfs image {} (direct I/O)", image.display()),
            Backing::LoopImage {
                image,
                buffered_because: Some(reason),
            } => write!(f, "btrfs image {} (buffered: {reason})", image.display()),
            Backing::Plain { reason } => write!(f, "plain directories ({reason})"),
        }
    }
}

/// A read-only snapshot of a home.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HomeSnapshot {
    /// Where the snapshot is (`ROOT/snapshots/ID/NAME`).
    pub path: PathBuf,
    /// How long taking it took, tool start-up included: the longest the
    /// workload can have been held up by it (btrfs flushes the home's dirty
    /// data and commits while taking it).
    pub took: Duration,
}

impl HomeVolumes {
    /// Prepares `root` (created if missing) to hold homes.
    ///
    /// - `root` on btrfs (including an image mounted there by an earlier
    ///   run of the runner): [`Backing::Btrfs`], or [`Backing::LoopImage`]
    ///   when what is mounted at `root` is `image` itself.
    /// - Otherwise, with an `image`: the image is created (sparse,
    ///   `image_bytes`, `mkfs.btrfs`) if it does not exist, and
    ///   loop-mounted at `root`: [`Backing::LoopImage`]. An existing image
    ///   keeps its size. Mounting over a non-empty `root` is refused: it
    ///   would hide what is there (homes kept as plain directories before
    ///   btrfs was available, say).
    /// - Btrfs not usable here (no btrfs-progs, no kernel support, no loop
    ///   devices, or no `image`): [`Backing::Plain`] with the reason, not an
    ///   error.
    ///
    /// Errors are real failures: permissions, I/O, a tool that failed,
    /// something other than btrfs already mounted at `root`.
    pub fn open(root: &Path, image: Option<&Path>, image_bytes: u64) -> Result<HomeVolumes> {
        std::fs::create_dir_all(root).map_err(|e| Error::io("create directory", root, e))?;
        let root = std::fs::canonicalize(root).map_err(|e| Error::io("resolve", root, e))?;
        let image = image.map(absolute_image_path).transpose()?;
        let search_path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
        let btrfs = find_binary(&search_path, "btrfs");

        let mounted = mounts_at(&root)?.pop();
        let backing = if is_btrfs(&root)? {
            match (&image, &mounted) {
                (Some(image), Some(mount)) if loop_backing_file(&mount.source) == *image => {
                    Backing::LoopImage {
                        image: image.clone(),
                        buffered_because: use_direct_io(&mount.source),
                    }
                }
                _ => Backing::Btrfs,
            }
        } else if let Some(mount) = mounted
            && let Some(image) = &image
        {
            return Err(Error::Unsupported(format!(
                "home volume root {} is a mount of {} ({}), not btrfs: unmount it to use the image {}",
                root.display(),
                mount.source,
                mount.fstype,
                image.display()
            )));
        } else if let Some(image) = image {
            match btrfs_unavailable(&search_path, btrfs.is_some(), &image) {
                Some(reason) => Backing::Plain { reason },
                None => {
                    let device = mount_image(&root, &image, image_bytes)?;
                    Backing::LoopImage {
                        image,
                        buffered_because: use_direct_io(&device),
                    }
                }
            }
        } else {
            Backing::Plain {
                reason: format!(
                    "{} is on {}, not btrfs, and no btrfs image is configured",
                    root.display(),
                    filesystem_name(filesystem_type(&root)?)
                ),
            }
        };
        let (backing, btrfs) = match (backing, btrfs) {
            (Backing::Plain { reason }, _) => (Backing::Plain { reason }, None),
            (_, None) => (
                Backing::Plain {
                    reason: "btrfs-progs is not installed (no `btrfs` on PATH)".to_owned(),
                },
                None,
            ),
            (backing, btrfs) => (backing, btrfs),
        };
        if btrfs.is_some() {
            ensure_nosuid_nodev(&root)?;
        }
        for dir in [
            root.join("homes"),
            root.join("snapshots"),
            root.join("roots"),
        ] {
            std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        }
        let unbounded_because = match (&backing, &btrfs) {
            (Backing::Plain { reason }, _) => {
                Some(format!("homes are plain directories: {reason}"))
            }
            (_, None) => Some("btrfs-progs is not installed".to_owned()),
            // Ours: quota groups are turned on (once; a restart finds them on).
            (Backing::LoopImage { .. }, Some(btrfs)) => enable_quotas(&root, btrfs).err(),
            // The operator's btrfs: quota groups cost every subvolume of the
            // whole filesystem, so they are the operator's to turn on.
            (Backing::Btrfs, Some(btrfs)) => (!quotas_on(&root, btrfs)).then(|| {
                format!(
                    "btrfs quota groups are off on {} (`btrfs quota enable` turns them on)",
                    root.display()
                )
            }),
        };
        Ok(HomeVolumes {
            root,
            backing,
            btrfs,
            unbounded_because,
        })
    }

    /// The root (canonical path) homes and snapshots are under.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// What holds the homes.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// Whether homes can be snapshotted, that is whether durable homes can
    /// be saved while their sandbox runs.
    pub fn can_snapshot(&self) -> bool {
        self.btrfs.is_some()
    }

    /// Why a home cannot be bounded here (`None`: it can): what the
    /// runner logs when it does not offer bounded homes.
    pub fn unbounded_because(&self) -> Option<&str> {
        self.unbounded_because.as_deref()
    }

    /// Bounds what the home of `id` may hold to `bytes`: a btrfs quota
    /// group limit on what the home's subvolume references, so a write
    /// that would take it past fails in the sandbox with `EDQUOT` ("Disk
    /// quota exceeded") and the home never holds more. Its snapshots are
    /// not counted (a save's snapshot shares the home's blocks, and the
    /// limit is of what the home itself references). Deleting files frees
    /// room; truncating or overwriting one may not, at the bound. A home
    /// that already holds more keeps its files and takes no new writes
    /// until it shrinks. Setting it again replaces the bound; `None` lifts
    /// it (while the runner itself writes the home: a restore).
    pub fn bound(&self, id: &str, bytes: Option<u64>) -> Result<()> {
        self.limit("bound the home", &self.home(id)?, bytes)
    }

    /// Sets (or with `None` lifts) the quota group limit on what the
    /// subvolume at `path` references.
    fn limit(&self, action: &'static str, path: &Path, bytes: Option<u64>) -> Result<()> {
        let btrfs = match (&self.unbounded_because, &self.btrfs) {
            (None, Some(btrfs)) => btrfs,
            (Some(reason), _) => return Err(Error::Unsupported(reason.clone())),
            (None, None) => return Err(Error::Unsupported("no btrfs here".to_owned())),
        };
        let bytes = bytes.map_or_else(|| "none".to_owned(), |b| b.to_string());
        run_tool(
            action,
            path,
            btrfs,
            &[
                OsStr::new("qgroup"),
                OsStr::new("limit"),
                OsStr::new(&bytes),
                path.as_os_str(),
            ],
        )?;
        Ok(())
    }

    /// Where the writable layer of sandbox `id`'s root file system goes:
    /// `ROOT/roots/ID`, or `None` where subvolumes cannot be made (plain
    /// directories: the layer stays with the sandbox's other files).
    pub fn layer(&self, id: &str) -> Result<Option<PathBuf>> {
        validate("sandbox id", id)?;
        Ok(self
            .btrfs
            .is_some()
            .then(|| self.root.join("roots").join(id)))
    }

    /// Makes the writable layer of sandbox `id` (a subvolume; an existing
    /// one is kept, with its files) and bounds what it may hold to
    /// `bytes`, as [`bound`](Self::bound) does a home: a write past it
    /// fails in the sandbox with `EDQUOT`. `None`: unbounded. Setting it at
    /// every launch means a runner restarted with another bound applies it
    /// to the sandboxes it launches again. Refused where
    /// [`layer`](Self::layer) is `None`; a bound where quota groups are
    /// off is refused with the reason ([`unbounded_because`](Self::unbounded_because)).
    pub fn create_layer(&self, id: &str, bytes: Option<u64>) -> Result<PathBuf> {
        let Some(layer) = self.layer(id)? else {
            return Err(Error::Unsupported(format!(
                "root layers need btrfs, and the volume under {} is {}",
                self.root.display(),
                self.backing
            )));
        };
        self.create_subvolume("create the root layer subvolume", &layer)?;
        if bytes.is_some() || self.unbounded_because.is_none() {
            self.limit("bound the root layer", &layer, bytes)?;
        }
        Ok(layer)
    }

    /// The home directory of sandbox `id`: `ROOT/homes/ID`.
    pub fn home(&self, id: &str) -> Result<PathBuf> {
        validate("sandbox id", id)?;
        Ok(self.root.join("homes").join(id))
    }

    /// Creates the home of `id`: a btrfs subvolume when snapshots work,
    /// else a directory. An existing home is kept as it is (a restarted
    /// sandbox finds its files).
    pub fn create(&self, id: &str) -> Result<PathBuf> {
        let home = self.home(id)?;
        self.create_subvolume("create the home subvolume", &home)?;
        Ok(home)
    }

    /// Makes a subvolume at `path` where btrfs is here, else a directory;
    /// whatever is there already is kept as it is.
    fn create_subvolume(&self, action: &'static str, path: &Path) -> Result<()> {
        match std::fs::symlink_metadata(path) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("inspect", path, e)),
        }
        match &self.btrfs {
            Some(btrfs) => {
                let made = run_tool(
                    action,
                    path,
                    btrfs,
                    &[
                        OsStr::new("subvolume"),
                        OsStr::new("create"),
                        path.as_os_str(),
                    ],
                );
                // Made meanwhile by another caller: kept as it is.
                if made.is_err() && std::fs::symlink_metadata(path).is_err() {
                    made?;
                }
            }
            None => match std::fs::create_dir(path) {
                Ok(()) => {}
                // Made meanwhile by another caller: kept as it is.
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::io("create directory", path, e)),
            },
        }
        Ok(())
    }

    /// Takes a read-only snapshot of the home of `id` at one instant, at
    /// `ROOT/snapshots/ID/NAME`. A snapshot by that name must not exist
    /// (an older one would not be of this instant). Refused when
    /// [`can_snapshot`](Self::can_snapshot) is false.
    pub fn snapshot(&self, id: &str, name: &str) -> Result<HomeSnapshot> {
        let home = self.home(id)?;
        validate("snapshot name", name)?;
        let Some(btrfs) = &self.btrfs else {
            return Err(Error::Unsupported(format!(
                "home snapshots need btrfs, and the homes under {} are {}",
                self.root.display(),
                self.backing
            )));
        };
        let metadata =
            std::fs::symlink_metadata(&home).map_err(|e| Error::io("snapshot", &home, e))?;
        if !is_subvolume(&metadata) {
            return Err(Error::Unsupported(format!(
                "home {} is a plain directory, not a btrfs subvolume (it was made before btrfs was available): it cannot be snapshotted",
                home.display()
            )));
        }
        let dir = self.snapshot_dir(id);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        let path = dir.join(name);
        if std::fs::symlink_metadata(&path).is_ok() {
            return Err(Error::io(
                "snapshot into",
                &path,
                std::io::Error::new(
                    ErrorKind::AlreadyExists,
                    "a snapshot by this name already exists: delete it first",
                ),
            ));
        }
        let started = Instant::now();
        read_only_snapshot("snapshot the home into", btrfs, &home, &path)?;
        Ok(HomeSnapshot {
            path,
            took: started.elapsed(),
        })
    }

    /// The names of the snapshots of `id` that exist, sorted (to find
    /// those a crash left behind). Entries that are not valid names are
    /// not snapshots of ours and are left out; [`remove`](Self::remove)
    /// still deletes them.
    pub fn snapshots(&self, id: &str) -> Result<Vec<String>> {
        validate("sandbox id", id)?;
        let mut names: Vec<String> = list_dir(&self.snapshot_dir(id))?
            .into_iter()
            .filter_map(|name| name.into_string().ok())
            .filter(|name| validate("snapshot name", name).is_ok())
            .collect();
        names.sort();
        Ok(names)
    }

    /// Deletes the snapshot `name` of `id`; deleting one that does not
    /// exist succeeds.
    pub fn delete_snapshot(&self, id: &str, name: &str) -> Result<()> {
        validate("sandbox id", id)?;
        validate("snapshot name", name)?;
        self.delete_tree(&self.snapshot_dir(id).join(name))
    }

    /// Deletes the home of `id` and all its snapshots, subvolumes the
    /// workload made inside the home included (any user can make one, and
    /// make it read-only). Removing what does not exist succeeds, so a
    /// removal cut short is finished by calling this again.
    pub fn remove(&self, id: &str) -> Result<()> {
        let home = self.home(id)?;
        let snapshots = self.snapshot_dir(id);
        for name in list_dir(&snapshots)? {
            self.delete_tree(&snapshots.join(name))?;
        }
        match std::fs::remove_dir(&snapshots) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove directory", &snapshots, e)),
        }
        self.delete_tree(&home)?;
        // Kernels before 6.8 keep a deleted subvolume's quota group: drop
        // those whose subvolume is gone by now (best effort: a group left
        // costs a few bytes and is dropped at the next removal).
        if let (None, Some(btrfs)) = (&self.unbounded_because, &self.btrfs) {
            let args = [
                OsStr::new("qgroup"),
                OsStr::new("clear-stale"),
                self.root.as_os_str(),
            ];
            let _ = run_tool("drop stale quota groups", &self.root, btrfs, &args);
        }
        Ok(())
    }

    /// Sets the home of `id` aside as `ROOT/kept/ID/NAME`, where nothing
    /// mounts it: a read-only snapshot where the home is a subvolume (the
    /// home itself stays, to be removed or written over by the caller),
    /// else the home directory itself, moved there with its write bits
    /// cleared. Returns the copy's path.
    pub fn keep(&self, id: &str, name: &str) -> Result<PathBuf> {
        let home = self.home(id)?;
        validate("kept copy name", name)?;
        let dir = self.root.join("kept").join(id);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        let path = dir.join(name);
        let metadata =
            std::fs::symlink_metadata(&home).map_err(|e| Error::io("keep aside", &home, e))?;
        match &self.btrfs {
            Some(btrfs) if is_subvolume(&metadata) => {
                read_only_snapshot("keep aside a copy of the home in", btrfs, &home, &path)?;
            }
            _ => {
                std::fs::rename(&home, &path).map_err(|e| Error::io("keep aside", &home, e))?;
                let mut permissions = metadata.permissions();
                permissions.set_mode(permissions.mode() & !0o222);
                std::fs::set_permissions(&path, permissions)
                    .map_err(|e| Error::io("make read-only", &path, e))?;
            }
        }
        Ok(path)
    }

    /// Every kept copy, as (sandbox id, name), sorted.
    pub fn kept(&self) -> Result<Vec<(String, String)>> {
        let root = self.root.join("kept");
        let mut copies = Vec::new();
        for id in list_dir(&root)? {
            let Some(id) = id.to_str().map(str::to_owned) else {
                continue;
            };
            if validate("sandbox id", &id).is_err() {
                continue;
            }
            for name in list_dir(&root.join(&id))? {
                if let Some(name) = name.to_str()
                    && validate("kept copy name", name).is_ok()
                {
                    copies.push((id.clone(), name.to_owned()));
                }
            }
        }
        copies.sort();
        Ok(copies)
    }

    /// Where the kept copy `name` of `id` is.
    pub fn kept_path(&self, id: &str, name: &str) -> Result<PathBuf> {
        validate("sandbox id", id)?;
        validate("kept copy name", name)?;
        Ok(self.root.join("kept").join(id).join(name))
    }

    /// Deletes the kept copy `name` of `id` (nothing there is fine).
    pub fn discard_kept(&self, id: &str, name: &str) -> Result<()> {
        let path = self.kept_path(id, name)?;
        if let Ok(metadata) = std::fs::symlink_metadata(&path)
            && !is_subvolume(&metadata)
            && metadata.is_dir()
        {
            // Moved here with its write bits cleared: give the owner's
            // back so that its entries can be removed.
            let mut permissions = metadata.permissions();
            permissions.set_mode(permissions.mode() | 0o700);
            let _ = std::fs::set_permissions(&path, permissions);
        }
        self.delete_tree(&path)?;
        let dir = self.root.join("kept").join(id);
        match std::fs::remove_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::DirectoryNotEmpty) => {
                Ok(())
            }
            Err(e) => Err(Error::io("remove directory", &dir, e)),
        }
    }

    /// Unmounts a loop-mounted image (retiring a runner, tests); the loop
    /// device goes with it. Nothing to do for other backings, or when the
    /// image is not mounted. Fails while anything still uses the volume
    /// (a running sandbox's home).
    pub fn unmount(self) -> Result<()> {
        if !matches!(self.backing, Backing::LoopImage { .. }) {
            return Ok(());
        }
        if mounts_at(&self.root)?.is_empty() {
            return Ok(());
        }
        run_tool(
            "unmount",
            &self.root,
            Path::new("umount"),
            &[self.root.as_os_str()],
        )?;
        Ok(())
    }

    fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.root.join("snapshots").join(id)
    }

    /// Deletes whatever is at `path` (a subvolume, a directory, a file);
    /// nothing there is fine.
    fn delete_tree(&self, path: &Path) -> Result<()> {
        let metadata = match std::fs::symlink_metadata(path) {
            Ok(metadata) => metadata,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io("inspect", path, e)),
        };
        if !metadata.is_dir() {
            return std::fs::remove_file(path).map_err(|e| Error::io("remove", path, e));
        }
        if let Some(btrfs) = &self.btrfs {
            if is_subvolume(&metadata) {
                return delete_subvolume(btrfs, path);
            }
            // A plain directory on btrfs (made before snapshots were
            // available) may still hold subvolumes the workload made, and
            // `remove_dir_all` cannot delete read-only ones.
            for nested in nested_subvolumes(path)? {
                delete_subvolume(btrfs, &nested)?;
            }
        }
        // A tree the sandbox wrote, of any depth.
        host::remove_tree(path)
    }
}

/// Ids and names become path components: `[A-Za-z0-9_.-]`, 1 to
/// [`NAME_BYTES_MAX`] bytes, not starting with `.` (no `.`, `..`, hidden
/// files).
fn validate(what: &str, value: &str) -> Result<()> {
    let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if value.is_empty()
        || value.len() > NAME_BYTES_MAX
        || value.starts_with('.')
        || !value.chars().all(valid_char)
    {
        return Err(Error::Invalid(format!(
            "{what} {value:?}: use 1-{NAME_BYTES_MAX} of A-Z a-z 0-9 _ - ., not starting with ."
        )));
    }
    Ok(())
}

/// Deletes the subvolume at `path`. The fast path is one `btrfs subvolume
/// delete` (the data is freed in the background). The kernel refuses to
/// delete a subvolume that holds other subvolumes (`ENOTEMPTY`), and to
/// delete one from inside a read-only one (`EROFS`); then the nested ones
/// are found, the subvolume made writable, and the nested ones deleted
/// first, depth first.
fn delete_subvolume(btrfs: &Path, path: &Path) -> Result<()> {
    let delete = || {
        run_tool(
            "delete the subvolume",
            path,
            btrfs,
            &[
                OsStr::new("subvolume"),
                OsStr::new("delete"),
                path.as_os_str(),
            ],
        )
    };
    let first = match delete() {
        Ok(_) => return Ok(()),
        Err(e) => e,
    };
    let nested = nested_subvolumes(path)?;
    if nested.is_empty() {
        return Err(first);
    }
    // Read-only or not, the flag no longer matters: it is being deleted.
    run_tool(
        "clear the read-only flag of",
        path,
        btrfs,
        &[
            OsStr::new("property"),
            OsStr::new("set"),
            OsStr::new("-f"),
            OsStr::new("-ts"),
            path.as_os_str(),
            OsStr::new("ro"),
            OsStr::new("false"),
        ],
    )?;
    for nested in nested {
        delete_subvolume(btrfs, &nested)?;
    }
    delete()?;
    Ok(())
}

/// The subvolumes directly inside the tree at `path` (not those inside
/// them), found by walking it. Only used when deleting found some, so a
/// whole home is walked only in that rare case.
fn nested_subvolumes(path: &Path) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let mut pending = vec![path.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| Error::io("list", &dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
            let child = entry.path();
            let metadata = match std::fs::symlink_metadata(&child) {
                Ok(metadata) => metadata,
                // Deleted meanwhile by a workload still running.
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("inspect", &child, e)),
            };
            if !metadata.is_dir() {
                continue;
            }
            if is_subvolume(&metadata) {
                found.push(child);
            } else {
                pending.push(child);
            }
        }
    }
    Ok(found)
}

fn is_subvolume(metadata: &std::fs::Metadata) -> bool {
    metadata.is_dir() && metadata.ino() == SUBVOLUME_ROOT_INODE
}

fn filesystem_type(path: &Path) -> Result<u32> {
    let stat = rustix::fs::statfs(path).map_err(|e| Error::io("statfs", path, e.into()))?;
    // `f_type` is a signed word on most targets: the magic, above
    // `i32::MAX`, is compared on its low 32 bits whatever the width.
    Ok((i128::from(stat.f_type) & 0xFFFF_FFFF) as u32)
}

/// A few common filesystems by name, for the reason given with plain homes.
fn filesystem_name(magic: u32) -> String {
    match magic {
        0xEF53 => "ext2/3/4".to_owned(),
        0x5846_5342 => "xfs".to_owned(),
        0x0102_1994 => "tmpfs".to_owned(),
        0x794C_7630 => "overlayfs".to_owned(),
        0x2FC1_2FC1 => "zfs".to_owned(),
        other => format!("a filesystem of type {other:#x}"),
    }
}

fn is_btrfs(path: &Path) -> Result<bool> {
    Ok(filesystem_type(path)? == BTRFS_SUPER_MAGIC)
}

/// Why an image cannot be made and mounted on this host, or `None` if it
/// can. Checked before touching anything, so that a host without btrfs
/// gets plain homes and a clear reason rather than a failed mount.
fn btrfs_unavailable(search_path: &OsStr, has_btrfs: bool, image: &Path) -> Option<String> {
    if !has_btrfs {
        return Some("btrfs-progs is not installed (no `btrfs` on PATH)".to_owned());
    }
    if !image.exists() && find_binary(search_path, "mkfs.btrfs").is_none() {
        return Some(format!(
            "btrfs-progs is not installed (no `mkfs.btrfs` on PATH to make {})",
            image.display()
        ));
    }
    if !kernel_has_btrfs(search_path) {
        return Some("the kernel has no btrfs support (not in /proc/filesystems)".to_owned());
    }
    if !Path::new("/dev/loop-control").exists() {
        return Some("no loop devices (/dev/loop-control is missing)".to_owned());
    }
    None
}

/// Whether the kernel knows btrfs, loading the module if it is only
/// available as one (as `mount` would).
fn kernel_has_btrfs(search_path: &OsStr) -> bool {
    let listed = || {
        std::fs::read_to_string("/proc/filesystems").is_ok_and(|text| {
            text.lines()
                .any(|line| line.trim_end().ends_with("\tbtrfs"))
        })
    };
    if listed() {
        return true;
    }
    if let Some(modprobe) = find_binary(search_path, "modprobe") {
        // Failure just means no module: the second look answers.
        let _ = host::run_tool(modprobe, &["-q", "btrfs"], None);
    }
    listed()
}

/// Makes the image if needed and loop-mounts it at `root`, which is not a
/// mount point. Returns the loop device (`/dev/loopN`).
fn mount_image(root: &Path, image: &Path, image_bytes: u64) -> Result<String> {
    if image.starts_with(root) {
        return Err(Error::Invalid(format!(
            "the home image {} is inside the home volume root {} it is mounted on",
            image.display(),
            root.display()
        )));
    }
    let leftovers = list_dir(root)?;
    if !leftovers.is_empty() {
        return Err(Error::Unsupported(format!(
            "home volume root {} is not empty ({} entries, e.g. {:?}) and not a mount: mounting the image {} over it would hide them; move them away or choose another root",
            root.display(),
            leftovers.len(),
            leftovers[0],
            image.display()
        )));
    }
    if !image.exists() {
        make_image(image, image_bytes)?;
    }
    run_tool(
        "mount the home image on",
        root,
        Path::new("mount"),
        &[
            OsStr::new("-t"),
            OsStr::new("btrfs"),
            OsStr::new("-o"),
            OsStr::new(MOUNT_OPTIONS),
            image.as_os_str(),
            root.as_os_str(),
        ],
    )?;
    if !is_btrfs(root)? {
        return Err(Error::Unsupported(format!(
            "{} is not btrfs after mounting the image {} on it",
            root.display(),
            image.display()
        )));
    }
    Ok(mounts_at(root)?
        .pop()
        .map(|mount| mount.source)
        .unwrap_or_default())
}

/// Switches loop device `device` (`/dev/loopN`) to direct I/O, if it is
/// not already, and returns why it stays buffered if it cannot be.
///
/// Buffered, every block written to a home is cached twice (in btrfs's
/// page cache, then in the image file's) and written back twice: a fresh
/// pull of the 2 GiB benchmark home into a new image took 10.9-17.4 s with
/// its `sync`, 7.8-8.8 s direct (BENCHMARKS.md, "Packs", "The home
/// image's loop device in direct I/O"). A flush
/// of the device is an fsync of the image file in both modes, so what a
/// save or a snapshot finds durable does not change. The kernel refuses
/// direct I/O where the image's filesystem cannot do it (no `O_DIRECT`, a
/// block size the device's cannot be aligned to): buffered is then the
/// only choice, and correct. The mode is kept by the device, so a mount
/// found at start (an earlier runner's) is checked too.
fn use_direct_io(device: &str) -> Option<String> {
    let Some(name) = Path::new(device).file_name() else {
        return Some(format!("{device} is not a loop device"));
    };
    let dio = Path::new("/sys/block").join(name).join("loop/dio");
    let is_direct = || std::fs::read_to_string(&dio).is_ok_and(|text| text.trim() == "1");
    if is_direct() {
        return None;
    }
    if let Err(e) = run_tool(
        "set direct I/O on",
        Path::new(device),
        Path::new("losetup"),
        &[OsStr::new("--direct-io=on"), OsStr::new(device)],
    ) {
        return Some(e.to_string());
    }
    if is_direct() {
        None
    } else {
        Some(format!(
            "{} still reads 0 after `losetup --direct-io=on`",
            dio.display()
        ))
    }
}

/// Makes the filesystem at `root` (canonical: the homes' volume, a shared
/// filesystem's root) `nosuid,nodev` where it is not
/// already: a mount at `root` is remounted with them, keeping its other
/// per-mount flags; a `root` inside a larger mount is bind-mounted on
/// itself first (with the mounts beneath it, which stay in view), so the
/// rest of that filesystem keeps its flags. Both
/// outlive the runner, like the image's mount, and a restart finds the
/// flags set and does nothing. Mounts beneath `root` keep their own flags.
pub fn ensure_nosuid_nodev(root: &Path) -> Result<()> {
    use rustix::fs::StatVfsMountFlags as Has;
    use rustix::mount::MountFlags;
    let flags = |root: &Path| {
        rustix::fs::statvfs(root)
            .map(|s| s.f_flag)
            .map_err(|e| Error::io("statvfs", root, e.into()))
    };
    let has = flags(root)?;
    if has.contains(Has::NOSUID | Has::NODEV) {
        return Ok(());
    }
    if mounts_at(root)?.is_empty() {
        // Recursive: a plain bind would hide the mounts beneath `root`.
        rustix::mount::mount_bind_recursive(root, root)
            .map_err(|e| Error::io("bind-mount on itself", root, e.into()))?;
    }
    // A bind remount changes only this mount's flags, all of them at once:
    // keep the ones it had.
    let mut keep = MountFlags::BIND | MountFlags::NOSUID | MountFlags::NODEV;
    for (had, flag) in [
        (Has::RDONLY, MountFlags::RDONLY),
        (Has::NOEXEC, MountFlags::NOEXEC),
        (Has::NOATIME, MountFlags::NOATIME),
        (Has::NODIRATIME, MountFlags::NODIRATIME),
        (Has::RELATIME, MountFlags::RELATIME),
    ] {
        if has.contains(had) {
            keep |= flag;
        }
    }
    rustix::mount::mount_remount(root, keep, "")
        .map_err(|e| Error::io("remount nosuid,nodev", root, e.into()))?;
    if !flags(root)?.contains(Has::NOSUID | Has::NODEV) {
        return Err(Error::Unsupported(format!(
            "{} is still not nosuid,nodev after remounting it so",
            root.display()
        )));
    }
    Ok(())
}

/// `btrfs subvolume snapshot -r FROM TO`: a read-only snapshot, which is
/// how a home is both saved and kept aside. `what` names the action in an
/// error.
fn read_only_snapshot(what: &'static str, btrfs: &Path, from: &Path, to: &Path) -> Result<()> {
    run_tool(
        what,
        to,
        btrfs,
        &[
            OsStr::new("subvolume"),
            OsStr::new("snapshot"),
            OsStr::new("-r"),
            from.as_os_str(),
            to.as_os_str(),
        ],
    )?;
    Ok(())
}

/// Makes a sparse btrfs image. It is made under a temporary name and
/// renamed once formatted, so a crash never leaves a half-made image that
/// every later start would fail to mount.
fn make_image(image: &Path, image_bytes: u64) -> Result<()> {
    if image_bytes < IMAGE_BYTES_MIN {
        return Err(Error::Invalid(format!(
            "home image size {image_bytes} bytes: at least {IMAGE_BYTES_MIN} bytes (btrfs needs about 114 MiB)"
        )));
    }
    let mut partial = image.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let file = std::fs::File::create(&partial).map_err(|e| Error::io("create", &partial, e))?;
    file.set_len(image_bytes)
        .map_err(|e| Error::io("size", &partial, e))?;
    drop(file);
    let search_path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
    let mkfs = find_binary(&search_path, "mkfs.btrfs").unwrap_or_else(|| "mkfs.btrfs".into());
    // mkfs.btrfs fsyncs what it writes.
    run_tool(
        "format the home image",
        &partial,
        &mkfs,
        &[OsStr::new("-q"), partial.as_os_str()],
    )?;
    std::fs::rename(&partial, image).map_err(|e| Error::io("rename into place", image, e))?;
    if let Some(parent) = image.parent() {
        sync_dir(parent)?;
    }
    Ok(())
}

/// The image path made absolute with its directory's symlinks resolved
/// (the directory is created if missing): how the kernel names a loop
/// device's backing file, so a mount of it is recognised, and never
/// mistaken by a tool for an option.
fn absolute_image_path(image: &Path) -> Result<PathBuf> {
    let invalid = || Error::Invalid(format!("home image {}: not a file path", image.display()));
    let name = image.file_name().ok_or_else(invalid)?;
    let parent = match image.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| Error::io("create directory", &parent, e))?;
    let parent = std::fs::canonicalize(&parent).map_err(|e| Error::io("resolve", &parent, e))?;
    let image = parent.join(name);
    // The image itself may be a symlink to the real file.
    match std::fs::canonicalize(&image) {
        Ok(real) => Ok(real),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(image),
        Err(e) => Err(Error::io("resolve", &image, e)),
    }
}

/// One line of `/proc/self/mountinfo`, the parts used here.
#[derive(Debug)]
struct Mount {
    fstype: String,
    source: String,
}

/// The mounts whose mount point is `path` (canonical), oldest first: the
/// last one is what `path` shows.
fn mounts_at(path: &Path) -> Result<Vec<Mount>> {
    let mountinfo = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(mountinfo).map_err(|e| Error::io("read", mountinfo, e))?;
    Ok(parse_mounts_at(&text, path))
}

/// Lines are `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL…] -
/// FSTYPE SOURCE SUPEROPTIONS`.
fn parse_mounts_at(mountinfo: &str, path: &Path) -> Vec<Mount> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = unescape_mountinfo(left.split(' ').nth(4)?);
            if Path::new(&mount_point) != path {
                return None;
            }
            let mut right = right.split(' ');
            Some(Mount {
                fstype: unescape_mountinfo(right.next()?),
                source: unescape_mountinfo(right.next()?),
            })
        })
        .collect()
}

/// The file behind loop device `source` (`/dev/loopN`), as the kernel
/// names it; empty if `source` is not a loop device.
fn loop_backing_file(source: &str) -> PathBuf {
    let Some(device) = Path::new(source).file_name() else {
        return PathBuf::new();
    };
    let sys = Path::new("/sys/block")
        .join(device)
        .join("loop/backing_file");
    std::fs::read_to_string(sys)
        .map(|text| PathBuf::from(text.trim_end_matches('\n')))
        .unwrap_or_default()
}

/// Names in directory `dir`; none if it does not exist.
fn list_dir(dir: &Path) -> Result<Vec<OsString>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list", dir, e)),
    };
    entries
        .map(|entry| {
            entry
                .map(|entry| entry.file_name())
                .map_err(|e| Error::io("list", dir, e))
        })
        .collect()
}

/// Whether btrfs quota groups are on for the filesystem of `root`
/// (`btrfs qgroup show` fails when they are off).
fn quotas_on(root: &Path, btrfs: &Path) -> bool {
    run_tool(
        "read the quota groups",
        root,
        btrfs,
        &[OsStr::new("qgroup"), OsStr::new("show"), root.as_os_str()],
    )
    .is_ok()
}

/// Turns btrfs quota groups on for the image mounted at `root` unless they
/// are on, and waits for their first count of what is there already (until
/// it ends, no limit holds). The reason as `Err` when that fails.
fn enable_quotas(root: &Path, btrfs: &Path) -> std::result::Result<(), String> {
    if quotas_on(root, btrfs) {
        return Ok(());
    }
    let arg = |a: &'static str| OsStr::new(a);
    let steps: [(&'static str, &[&OsStr]); 2] = [
        (
            "turn quota groups on",
            &[arg("quota"), arg("enable"), root.as_os_str()],
        ),
        (
            "count what the homes hold",
            &[arg("quota"), arg("rescan"), arg("-w"), root.as_os_str()],
        ),
    ];
    for (action, args) in steps {
        run_tool(action, root, btrfs, args).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Runs `program args…` through the host's tool runner and returns its
/// stdout. A failure is [`Error::Io`] on `path` whose message has the
/// command line, the exit status and what the tool said on stderr, on one
/// line.
fn run_tool(action: &'static str, path: &Path, program: &Path, args: &[&OsStr]) -> Result<String> {
    host::run_tool(program, args, None).map_err(|failure| {
        let source = match &failure.kind {
            ToolFailureKind::Run { source, .. } => std::io::Error::new(
                source.kind(),
                format!("could not start `{}`: {source}", program.display()),
            ),
            ToolFailureKind::Exited { status, .. } => {
                let status = match status {
                    Some(code) => format!("exit status {code}"),
                    None => "killed by a signal".to_owned(),
                };
                std::io::Error::other(format!(
                    "`{}` failed ({status}): {}",
                    failure.command,
                    failure.said("; ")
                ))
            }
        };
        Error::io(action, path, source)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_matched_unescaped() {
        let mountinfo = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
79 27 0:49 / /tmp/a\\040b/root rw,relatime - btrfs /dev/loop0 rw,subvol=/
80 79 0:50 / /tmp/a\\040b/root rw,relatime - tmpfs tmpfs rw
81 27 0:51 / /tmp/a\\040b/root/x rw,relatime - tmpfs tmpfs rw
";
        let mounts = parse_mounts_at(mountinfo, Path::new("/tmp/a b/root"));
        let seen: Vec<_> = mounts
            .iter()
            .map(|m| (m.fstype.as_str(), m.source.as_str()))
            .collect();
        assert_eq!(seen, [("btrfs", "/dev/loop0"), ("tmpfs", "tmpfs")]);
        assert!(parse_mounts_at(mountinfo, Path::new("/tmp")).is_empty());
    }

    #[test]
    fn names() {
        for good in [
            "a",
            "sbx_0123",
            "a.b-c_D",
            "-x",
            &"x".repeat(NAME_BYTES_MAX),
        ] {
            assert!(validate("name", good).is_ok(), "{good:?}");
        }
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "a/b",
            "a b",
            "é",
            "a\0",
            &"x".repeat(NAME_BYTES_MAX + 1),
        ] {
            assert!(
                matches!(validate("name", bad), Err(Error::Invalid(_))),
                "{bad:?}"
            );
        }
    }
}
