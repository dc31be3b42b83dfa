//! `oci::tmpfs::ensure`: a directory becomes a tmpfs of the asked size,
//! and one mounted smaller before (a runner restarted with a larger
//! capacity finds its own, older mount) grows to it, keeping what it
//! holds. Needs root; the mount is undone by [`Mounted`]'s `Drop`.

use std::path::PathBuf;

struct Mounted {
    dir: tempfile::TempDir,
}

impl Mounted {
    fn path(&self) -> PathBuf {
        self.dir.path().join("secrets")
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(self.path(), rustix::mount::UnmountFlags::DETACH);
    }
}

#[test]
fn a_smaller_tmpfs_grows_to_the_size_asked_and_keeps_its_files() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the tmpfs tests mount: they need root (scripts/test.sh runs them as root)"
    );
    let mounted = Mounted {
        dir: tempfile::Builder::new()
            .prefix("roost-tmpfs-it-")
            .tempdir()
            .expect("temp dir"),
    };
    let dir = mounted.path();
    oci::tmpfs::ensure(&dir, 1 << 20).expect("a 1 MiB tmpfs");
    assert!(oci::tmpfs::is_tmpfs(&dir).expect("statfs"));
    assert_eq!(oci::tmpfs::size(&dir).expect("size"), 1 << 20);
    std::fs::write(dir.join("kept"), b"before").expect("a file on it");
    let big = vec![7u8; 2 << 20];
    assert!(
        std::fs::write(dir.join("big"), &big).is_err(),
        "2 MiB do not fit on 1 MiB"
    );
    let _ = std::fs::remove_file(dir.join("big"));

    oci::tmpfs::ensure(&dir, 8 << 20).expect("grown to 8 MiB");
    assert_eq!(oci::tmpfs::size(&dir).expect("size"), 8 << 20);
    assert_eq!(std::fs::read(dir.join("kept")).expect("kept"), b"before");
    std::fs::write(dir.join("big"), &big).expect("2 MiB fit on 8 MiB");

    // Never shrunk: a smaller ask leaves it as it is.
    oci::tmpfs::ensure(&dir, 1 << 20).expect("asked smaller");
    assert_eq!(oci::tmpfs::size(&dir).expect("size"), 8 << 20);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&dir).expect("stat").permissions(),
    );
    assert_eq!(mode & 0o777, 0o700);
}

/// A directory that lies on a tmpfs (the host's `/run` on most systems)
/// is not the runner's own: it gets a mount of its own, of the size
/// asked, so the secrets can never fill the host's.
#[test]
fn a_directory_on_another_tmpfs_gets_its_own_bounded_mount() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the tmpfs tests mount: they need root (scripts/test.sh runs them as root)"
    );
    let outer = Mounted {
        dir: tempfile::Builder::new()
            .prefix("roost-tmpfs-it-")
            .tempdir()
            .expect("temp dir"),
    };
    // The host's /run, as it were: a 64 MiB tmpfs.
    oci::tmpfs::ensure(&outer.path(), 64 << 20).expect("a 64 MiB tmpfs");
    let inner = outer.path().join("roost/secrets/runner");
    assert!(oci::tmpfs::is_tmpfs(&outer.path()).expect("statfs"));
    std::fs::create_dir_all(&inner).expect("a directory on it");
    assert!(
        !oci::tmpfs::is_tmpfs_mount(&inner).expect("stat"),
        "on a tmpfs, not one"
    );
    // Named through a symlink from a disk: still not one.
    let link = outer.dir.path().join("link");
    std::os::unix::fs::symlink(&inner, &link).expect("symlink");
    assert!(!oci::tmpfs::is_tmpfs_mount(&link).expect("stat"));
    // What an older runner left there, on the outer tmpfs, comes onto
    // the new mount (not hidden under it).
    std::fs::create_dir_all(inner.join("sbx_1/files")).expect("dirs");
    std::fs::write(inner.join("sbx_1/files/token"), b"kept").expect("a secret");
    std::fs::set_permissions(
        inner.join("sbx_1/files/token"),
        std::os::unix::fs::PermissionsExt::from_mode(0o400),
    )
    .expect("chmod");

    oci::tmpfs::ensure(&inner, 1 << 20).expect("a 1 MiB tmpfs of its own");
    let unmount_inner = Unmount(inner.clone());
    assert!(oci::tmpfs::is_tmpfs_mount(&inner).expect("stat"));
    assert!(oci::tmpfs::is_tmpfs_mount(&link).expect("stat"));
    let token = inner.join("sbx_1/files/token");
    assert_eq!(std::fs::read(&token).expect("kept"), b"kept");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&token).expect("stat").permissions()
        ) & 0o777,
        0o400
    );
    assert_eq!(
        std::fs::read_dir(inner.parent().expect("a parent"))
            .expect("list")
            .count(),
        1,
        "nothing set aside is left"
    );
    assert_eq!(oci::tmpfs::size(&inner).expect("size"), 1 << 20);
    assert!(
        std::fs::write(inner.join("big"), vec![7u8; 2 << 20]).is_err(),
        "bounded by its own size, not the outer one's"
    );
    // Found again as its own by a restarted runner: not mounted twice.
    oci::tmpfs::ensure(&inner, 1 << 20).expect("found");
    assert_eq!(oci::tmpfs::size(&inner).expect("size"), 1 << 20);
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let at = inner.to_str().expect("utf-8");
    assert_eq!(
        mountinfo
            .lines()
            .filter(|line| line.split(' ').nth(4) == Some(at))
            .count(),
        1,
        "one mount at {at}"
    );
    drop(unmount_inner);
}

/// Unmounts its path when dropped (before the outer mount goes).
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
    }
}
