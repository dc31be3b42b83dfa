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
    make_mount_points(&rootfs)
}

/// The directories every sandbox has, with their usual modes, made
/// inside the root without following any symlink in it. The root keeps
/// what the sandbox wrote in an earlier life (and an image brings its own
/// tree), so `var` may be a symlink to a host path: the runner, working in
/// the host's mount namespace, would otherwise make `var/tmp` there and
/// set it world-writable. A name the sandbox replaced by a symlink is left
/// as it is and nothing is made through it (the runtime resolves mount
/// points inside the root itself).
fn make_mount_points(rootfs: &Path) -> Result<()> {
    use rustix::fs::{Mode, OFlags};
    let root = rustix::fs::open(
        rootfs,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::io("open", rootfs, e.into()))?;
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
        create_dir_beneath(&root, rootfs, dir, mode)?;
    }
    Ok(())
}

/// Makes `root`/`relative` with `mode` unless it is there. No component is
/// followed if it is a symlink: a parent that is one (or is not a
/// directory) means the directory is not made, and a symlink at the name
/// itself is left alone. Anything else already at the name is an error,
/// as before.
fn create_dir_beneath(
    root: &std::os::fd::OwnedFd,
    rootfs: &Path,
    relative: &str,
    mode: u32,
) -> Result<()> {
    use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
    use rustix::io::Errno;
    let path = rootfs.join(relative);
    let (parent, name) = match relative.rsplit_once('/') {
        Some((parent, name)) => (Some(parent), name),
        None => (None, relative),
    };
    let no_symlinks = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS;
    let parent = match parent {
        None => rustix::io::dup(root).map_err(|e| Error::io("open", rootfs, e.into()))?,
        Some(parent) => match rustix::fs::openat2(
            root,
            parent,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            no_symlinks,
        ) {
            Ok(fd) => fd,
            // A symlink or a file where the parent should be: the sandbox's
            // own doing, and nothing is made through it.
            Err(Errno::LOOP | Errno::NOTDIR | Errno::XDEV) => return Ok(()),
            Err(e) => return Err(Error::io("open", rootfs.join(parent), e.into())),
        },
    };
    match rustix::fs::mkdirat(&parent, name, Mode::from_raw_mode(mode)) {
        Ok(()) => {
            // The umask may have cleared bits (1777 for tmp): set them on
            // the directory just made, opened without following a link.
            let made = rustix::fs::openat2(
                &parent,
                name,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                no_symlinks,
            )
            .map_err(|e| Error::io("open", &path, e.into()))?;
            rustix::fs::fchmod(&made, Mode::from_raw_mode(mode))
                .map_err(|e| Error::io("set the mode of", &path, e.into()))
        }
        Err(Errno::EXIST) => {
            let stat = rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| Error::io("inspect", &path, e.into()))?;
            match FileType::from_raw_mode(stat.st_mode) {
                FileType::Directory | FileType::Symlink => Ok(()),
                _ => Err(Error::io(
                    "create directory",
                    &path,
                    std::io::Error::from(ErrorKind::AlreadyExists),
                )),
            }
        }
        Err(e) => Err(Error::io("create directory", &path, e.into())),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn mount_points_are_never_made_through_a_symlink_in_the_root() {
        let scratch = tempfile::tempdir().expect("ok");
        let rootfs = scratch.path().join("rootfs");
        let outside = scratch.path().join("host");
        std::fs::create_dir_all(&rootfs).expect("ok");
        std::fs::create_dir_all(&outside).expect("ok");
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o700)).expect("ok");
        // What a sandbox root can do in one life to its next start.
        std::os::unix::fs::symlink(&outside, rootfs.join("var")).expect("ok");
        std::os::unix::fs::symlink(&outside, rootfs.join("tmp")).expect("ok");

        make_mount_points(&rootfs).expect("ok");

        assert!(!outside.join("tmp").exists(), "var/tmp made on the host");
        let mode = std::fs::metadata(&outside)
            .expect("ok")
            .permissions()
            .mode()
            & 0o7777;
        assert_eq!(mode, 0o700, "a host directory's mode changed");
        assert!(rootfs.join("var").is_symlink() && rootfs.join("tmp").is_symlink());
        for (dir, mode) in [("proc", 0o555), ("root", 0o700), (".roost", 0o755)] {
            let made = std::fs::symlink_metadata(rootfs.join(dir)).expect("ok");
            assert!(made.is_dir(), "{dir}");
            assert_eq!(made.permissions().mode() & 0o7777, mode, "{dir}");
        }
    }

    #[test]
    fn mount_points_get_their_modes_whatever_the_umask_and_a_file_in_the_way_is_an_error() {
        let scratch = tempfile::tempdir().expect("ok");
        let rootfs = scratch.path().join("rootfs");
        std::fs::create_dir_all(&rootfs).expect("ok");
        make_mount_points(&rootfs).expect("ok");
        for dir in ["tmp", "var/tmp"] {
            let mode = std::fs::metadata(rootfs.join(dir))
                .expect("ok")
                .permissions()
                .mode();
            assert_eq!(mode & 0o7777, 0o1777, "{dir}");
        }
        // Again over what is there: nothing changes, nothing fails.
        make_mount_points(&rootfs).expect("ok");

        std::fs::remove_dir(rootfs.join("home")).expect("ok");
        std::fs::write(rootfs.join("home"), b"").expect("ok");
        let err = make_mount_points(&rootfs).expect_err("refused").to_string();
        assert!(err.contains("home"), "{err}");
    }
}
