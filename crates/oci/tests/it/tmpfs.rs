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
