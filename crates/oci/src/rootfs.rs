//! The sandbox's root directory on the host: for the default image a
//! plain writable directory with the host's merged-/usr symlinks and the
//! mount points the spec mounts over; for an imported image an overlay of
//! the image (read-only lower layer) under the sandbox's own upper layer.
//! Unmounting it again at delete.

use std::io::ErrorKind;
use std::path::Path;

use crate::config::{RootImage, SandboxConfig, SandboxPaths};
use crate::error::{Error, Result};
use crate::probe::{HostSystem, SystemEntry};

/// Makes the sandbox's root directory on the host: the writable layer, the
/// merged-/usr symlinks and the mount points with their usual modes. Files
/// the sandbox wrote earlier are left as they are; a mismatched symlink
/// (the host changed) is replaced. For an imported image the root is an
/// overlay of the image under the sandbox's upper layer, mounted here.
pub fn prepare_rootfs(config: &SandboxConfig, host: &HostSystem) -> Result<()> {
    let rootfs = config.paths.rootfs();
    create_dir(&rootfs, 0o755)?;
    if let RootImage::Tree(lower) = &config.image {
        mount_overlay(&config.paths, lower)?;
    }
    for entry in host.entries_for(&config.image) {
        match entry {
            SystemEntry::Directory(path) => create_dir(&rootfs.join(&path[1..]), 0o755)?,
            SystemEntry::Symlink { path, target } => {
                let link = rootfs.join(&path[1..]);
                match std::fs::read_link(&link) {
                    Ok(existing) if existing == *target => {}
                    Ok(_) => {
                        std::fs::remove_file(&link).map_err(|e| Error::io("replace", &link, e))?;
                        symlink(target, &link)?;
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => symlink(target, &link)?,
                    // A directory the sandbox made where the host has a
                    // symlink: leave it, the runtime will mount over it.
                    Err(_) => {}
                }
            }
        }
    }
    for (dir, mode) in [
        ("proc", 0o555),
        ("sys", 0o555),
        ("dev", 0o755),
        ("tmp", 0o1777),
        ("run", 0o755),
        ("workspace", 0o755),
        (".roost", 0o755),
        ("var", 0o755),
        ("var/tmp", 0o1777),
        ("root", 0o700),
        ("home", 0o755),
    ] {
        create_dir(&rootfs.join(dir), mode)?;
    }
    Ok(())
}

/// Mounts `lower` (read-only) under the sandbox's upper layer at its
/// rootfs, replacing a mount left by an earlier life of the sandbox (a
/// runner that died leaves its mounts behind).
fn mount_overlay(paths: &SandboxPaths, lower: &Path) -> Result<()> {
    use rustix::mount::{MountFlags, mount};
    let rootfs = paths.rootfs();
    unmount_rootfs(paths)?;
    for dir in [paths.upper(), paths.overlay_work()] {
        create_dir(&dir, 0o755)?;
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        overlay_path(lower)?,
        overlay_path(&paths.upper())?,
        overlay_path(&paths.overlay_work())?,
    );
    mount(
        "overlay",
        &rootfs,
        "overlay",
        MountFlags::NOSUID | MountFlags::NODEV,
        Some(
            std::ffi::CString::new(options)
                .map_err(|e| Error::io("mount", &rootfs, e.into()))?
                .as_c_str(),
        ),
    )
    .map_err(|e| Error::io("mount the image overlay at", &rootfs, e.into()))
}

/// A path as overlayfs options take it: `,` `:` and `\` would split or
/// escape the option string, so such paths are refused.
fn overlay_path(path: &Path) -> Result<String> {
    let text = path.to_str().unwrap_or("");
    if text.is_empty() || text.contains([',', ':', '\\']) {
        return Err(Error::Invalid(format!(
            "{} cannot be an overlay layer (use a path without , : or \\)",
            path.display()
        )));
    }
    Ok(text.to_owned())
}

/// Unmounts an imported image's overlay from the sandbox's rootfs, if
/// mounted (a plain directory, or nothing, is fine). Idempotent.
pub fn unmount_rootfs(paths: &SandboxPaths) -> Result<()> {
    use rustix::mount::{UnmountFlags, unmount};
    let rootfs = paths.rootfs();
    loop {
        match unmount(&rootfs, UnmountFlags::DETACH) {
            // Several lives may have stacked mounts: peel them all.
            Ok(()) => continue,
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => return Ok(()),
            Err(e) => return Err(Error::io("unmount", &rootfs, e.into())),
        }
    }
}

fn symlink(target: &Path, link: &Path) -> Result<()> {
    std::os::unix::fs::symlink(target, link).map_err(|e| Error::io("create symlink", link, e))
}

fn create_dir(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    match std::fs::DirBuilder::new().mode(mode).create(path) {
        Ok(()) => {
            // The umask may have cleared bits (1777 for tmp).
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                .map_err(|e| Error::io("set the mode of", path, e))
        }
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            if path.is_dir() {
                Ok(())
            } else {
                Err(Error::io("create directory", path, e))
            }
        }
        Err(e) => Err(Error::io("create directory", path, e)),
    }
}
