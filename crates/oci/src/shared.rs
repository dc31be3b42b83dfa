//! Shared filesystems' directories, mounted into a sandbox without a path
//! the sandbox could redirect. Other sandboxes write the same filesystem,
//! so a component of a subpath may be swapped for a symlink at any moment;
//! a path handed to the runtime would be followed wherever it leads. So
//! each directory is opened beneath its filesystem's root
//! (`openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: no `..`, absolute
//! symlink or symlink leaving the root resolves), bind-mounted from that
//! descriptor (`/proc/self/fd/N`, which names the opened directory itself)
//! onto `DIR/shared/I`, a path only the runner writes, and the runtime
//! binds from there. Once the runtime has made its mounts the staging
//! mounts are detached: the sandbox's mount namespace keeps its own.
//!
//! A staging directory is only ever `rmdir`ed, never removed recursively:
//! a mount still on it makes that fail rather than delete shared files.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::config::{SandboxConfig, SandboxPaths, SharedMount};
use crate::error::{Error, Result};

/// Makes a shared filesystem's root (`--filesystem ID=PATH`) safe for
/// the host it is on. A sandbox runs as the host's root with `CAP_FSETID`
/// and `CAP_MKNOD`: a `chmod 4755` or a `mknod` beneath the root makes a
/// setuid-root program or a device node on the host, which its own view
/// (`nosuid,nodev`) does not stop any host user from running or opening.
/// So the root is made a `nosuid,nodev` mount
/// ([`volumes::ensure_nosuid_nodev`](crate::volumes::ensure_nosuid_nodev));
/// a mount beneath it without both is refused, naming it (its flags are
/// its own, and the operator's to set).
pub fn ensure_host_safe(root: &Path) -> Result<()> {
    use rustix::fs::StatVfsMountFlags as Has;
    let root = std::fs::canonicalize(root).map_err(|e| Error::io("resolve", root, e))?;
    crate::volumes::ensure_nosuid_nodev(&root)?;
    let mountinfo = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(mountinfo).map_err(|e| Error::io("read", mountinfo, e))?;
    for line in text.lines() {
        let Some(field) = line.split(' ').nth(4) else {
            continue;
        };
        let point = PathBuf::from(crate::host::unescape_mountinfo(field));
        if point == root || !point.starts_with(&root) {
            continue;
        }
        let flags = rustix::fs::statvfs(&point)
            .map_err(|e| Error::io("statvfs", &point, e.into()))?
            .f_flag;
        if !flags.contains(Has::NOSUID | Has::NODEV) {
            return Err(Error::Unsupported(format!(
                "{} is mounted beneath shared filesystem root {} without nosuid,nodev: sandboxes could plant setuid programs or device nodes there; mount it nosuid,nodev",
                point.display(),
                root.display()
            )));
        }
    }
    Ok(())
}

/// Where the `index`th shared mount of a sandbox is staged.
pub fn staged(paths: &SandboxPaths, index: usize) -> PathBuf {
    paths.shared().join(index.to_string())
}

/// The directory `mount` names, opened beneath its filesystem's root
/// (`O_PATH`): a missing one is [`Error::MountSourceMissing`], one whose
/// path leads out of the root [`Error::Invalid`].
pub fn open_beneath(mount: &SharedMount) -> Result<OwnedFd> {
    let root = rustix::fs::open(
        &mount.root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        Error::MountSourceMissing(format!(
            "shared filesystem {} is not mounted on this runner ({e})",
            mount.name
        ))
    })?;
    let subpath = if mount.subpath.is_empty() {
        "."
    } else {
        mount.subpath.as_str()
    };
    let opened = rustix::fs::openat2(
        &root,
        subpath,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
    );
    opened.map_err(|e| match e {
        Errno::NOENT | Errno::NOTDIR => Error::MountSourceMissing(format!(
            "shared filesystem {} has no directory {:?} (it must exist; nothing is created)",
            mount.name, mount.subpath
        )),
        Errno::XDEV | Errno::LOOP => Error::Invalid(format!(
            "shared filesystem {}: {:?} leads outside the filesystem",
            mount.name, mount.subpath
        )),
        other => Error::io(
            "open shared directory",
            Path::new(&mount.name).join(&mount.subpath),
            other.into(),
        ),
    })
}

/// Stages every shared mount of `config` (see the module doc). On error
/// nothing stays staged.
pub fn stage(config: &SandboxConfig) -> Result<()> {
    unstage(&config.paths)?;
    if config.shared.is_empty() {
        return Ok(());
    }
    let result = (|| {
        let dir = config.paths.shared();
        create_private_dir(&dir)?;
        for (index, mount) in config.shared.iter().enumerate() {
            let fd = open_beneath(mount)?;
            let target = staged(&config.paths, index);
            create_private_dir(&target)?;
            let source = format!("/proc/self/fd/{}", fd.as_raw_fd());
            rustix::mount::mount_bind(source.as_str(), &target)
                .map_err(|e| Error::io("bind-mount a shared directory on", &target, e.into()))?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = unstage(&config.paths);
    }
    result
}

/// Detaches every staged mount and removes the staging directories
/// (`rmdir` only). Idempotent.
pub fn unstage(paths: &SandboxPaths) -> Result<()> {
    let dir = paths.shared();
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("read", &dir, e)),
    };
    for entry in entries {
        let path = entry.map_err(|e| Error::io("read", &dir, e))?.path();
        loop {
            match rustix::mount::unmount(&path, rustix::mount::UnmountFlags::DETACH) {
                Ok(()) => continue,
                Err(Errno::INVAL | Errno::NOENT) => break,
                Err(e) => return Err(Error::io("unmount", &path, e.into())),
            }
        }
        match std::fs::remove_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &path, e)),
        }
    }
    match std::fs::remove_dir(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", &dir, e)),
    }
}

fn create_private_dir(path: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(Error::io("create directory", path, e)),
    }
}
