//! A directory backed by memory: what a runner holds secrets on. Mounted
//! here (`nosuid,nodev,noexec`, mode 0700) unless the directory already is
//! the root of a tmpfs mount (a restarted runner finds its own), so
//! nothing written below it reaches a disk and what is written is bounded
//! by the mount's own size. A directory that merely lies on a tmpfs (the
//! host's `/run` on most systems) is not one: writing there would share,
//! and could fill, the host's.

use std::path::Path;

use crate::error::{Error, Result};

/// `statfs(2)`'s `f_type` of a tmpfs (`TMPFS_MAGIC`).
pub const TMPFS_MAGIC: u32 = 0x0102_1994;

/// Whether `path` lies on a tmpfs.
pub fn is_tmpfs(path: &Path) -> Result<bool> {
    let stat = rustix::fs::statfs(path).map_err(|e| Error::io("statfs", path, e.into()))?;
    // `f_type` is signed on most targets: compared on its low 32 bits.
    Ok((i128::from(stat.f_type) & 0xFFFF_FFFF) as u32 == TMPFS_MAGIC)
}

/// Whether `path` is the root of a tmpfs mount: a tmpfs on another
/// device than the directory above it as the kernel resolves it (`..`,
/// through any symlink; each tmpfs mount is a device of its own), not a
/// directory on the host's `/run`.
pub fn is_tmpfs_mount(path: &Path) -> Result<bool> {
    if !is_tmpfs(path)? {
        return Ok(false);
    }
    let device = |path: &Path| {
        rustix::fs::stat(path)
            .map(|stat| (stat.st_dev, stat.st_ino))
            .map_err(|e| Error::io("stat", path, e.into()))
    };
    let (here, above) = (device(path)?, device(&path.join(".."))?);
    // `/` is its own `..`: a root that is a tmpfs is a mount.
    Ok(here == above || here.0 != above.0)
}

/// Makes `dir` (0700) and mounts a tmpfs of at most `size_bytes` on it,
/// unless it is the root of a tmpfs mount already; one that is smaller
/// (mounted for a smaller capacity before a restart) is remounted to
/// `size_bytes`, keeping what it holds.
pub fn ensure(dir: &Path, size_bytes: u64) -> Result<()> {
    use rustix::mount::MountFlags;
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
    let flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    let options = |size: u64| {
        std::ffi::CString::new(format!("mode=0700,size={size}"))
            .map_err(|_| Error::Invalid("tmpfs options".to_owned()))
    };
    // What the directory held before it was a mount of its own (written
    // by a runner that took the host's /run for its tmpfs) is set aside,
    // then copied onto the mount: hidden under it, it would be neither
    // found nor ever removed.
    let aside = dir.with_file_name(format!(
        ".{}.before-mount",
        dir.file_name()
            .map_or_else(Default::default, |n| n.to_string_lossy())
    ));
    if !is_tmpfs_mount(dir)? {
        let holds = std::fs::read_dir(dir)
            .map_err(|e| Error::io("list", dir, e))?
            .next()
            .is_some();
        if holds && !aside.exists() {
            std::fs::rename(dir, &aside).map_err(|e| Error::io("set aside", dir, e))?;
            std::fs::create_dir(dir).map_err(|e| Error::io("create directory", dir, e))?;
        }
        rustix::mount::mount(
            "tmpfs",
            dir,
            "tmpfs",
            flags,
            Some(options(size_bytes)?.as_c_str()),
        )
        .map_err(|e| Error::io("mount a tmpfs on", dir, e.into()))?;
    } else if size(dir)? < size_bytes {
        rustix::mount::mount_remount(dir, flags, &options(size_bytes)?)
            .map_err(|e| Error::io("grow the tmpfs on", dir, e.into()))?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| Error::io("chmod", dir, e))?;
    if aside.exists() {
        copy_tree(&aside, dir)?;
        std::fs::remove_dir_all(&aside).map_err(|e| Error::io("remove", &aside, e))?;
    }
    Ok(())
}

/// Copies the directories and files under `from` into `to` (made where
/// missing), with their permission bits; anything else is left.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for entry in std::fs::read_dir(from).map_err(|e| Error::io("list", from, e))? {
        let entry = entry.map_err(|e| Error::io("list", from, e))?;
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        let metadata =
            std::fs::symlink_metadata(&source).map_err(|e| Error::io("stat", &source, e))?;
        let mode = std::fs::Permissions::from_mode(metadata.permissions().mode() & 0o777);
        if metadata.is_dir() {
            match std::fs::create_dir(&target) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                    return Err(Error::io("create directory", &target, e));
                }
                _ => {}
            }
            copy_tree(&source, &target)?;
        } else if metadata.is_file() {
            std::fs::copy(&source, &target).map_err(|e| Error::io("copy", &source, e))?;
        } else {
            continue;
        }
        std::fs::set_permissions(&target, mode).map_err(|e| Error::io("chmod", &target, e))?;
    }
    Ok(())
}

/// The size of the file system at `path`, in bytes.
pub fn size(path: &Path) -> Result<u64> {
    let stat = rustix::fs::statvfs(path).map_err(|e| Error::io("statvfs", path, e.into()))?;
    Ok(stat.f_blocks.saturating_mul(stat.f_frsize))
}
