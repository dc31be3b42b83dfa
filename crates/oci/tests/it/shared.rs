//! A shared filesystem's root on the host (`oci::shared::ensure_host_safe`):
//! what a sandbox's root plants beneath it (a setuid-root copy of `id`, a
//! device node) is neither setuid-effective nor openable for the host once
//! the runner has started, whatever the root was mounted with. The root is
//! made on a tmpfs mounted here without `nosuid,nodev`, so the attack is
//! real on any host; needs root and `setpriv` (util-linux). Every mount is
//! undone by [`Scratch`]'s `Drop`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::fs::StatVfsMountFlags;

/// A temp dir with a tmpfs at `fs/` (no `nosuid`, no `nodev`).
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Scratch {
        assert!(
            rustix::process::geteuid().is_root(),
            "the shared root tests mount: they need root (scripts/test.sh runs them as root)"
        );
        let dir = tempfile::Builder::new()
            .prefix("roost-shared-it-")
            .tempdir()
            .expect("temp dir");
        // Open as a real shared directory's parents are: only the mount's
        // flags may keep a host user from the planted program.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod the temp dir");
        let scratch = Scratch { dir };
        let fs = scratch.fs();
        std::fs::create_dir(&fs).expect("fs dir");
        mount_tmpfs(&fs, "mode=0755");
        scratch
    }

    fn fs(&self) -> PathBuf {
        self.dir.path().join("fs")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Detached whole: the tmpfs and every mount beneath it, the
        // root's bind and the submounts it shadows included.
        let fs = self.fs();
        while mounts_beneath(&fs) > 0 {
            if rustix::mount::unmount(&fs, rustix::mount::UnmountFlags::DETACH).is_err() {
                break;
            }
        }
    }
}

fn mount_tmpfs(at: &Path, options: &str) {
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o", options, "tmpfs"])
        .arg(at)
        .status()
        .expect("mount");
    assert!(status.success(), "mount a tmpfs on {}", at.display());
}

/// Mounts at or beneath `path` (the temp paths have nothing mountinfo
/// escapes).
fn mounts_beneath(path: &Path) -> usize {
    mount_points()
        .iter()
        .filter(|point| point.starts_with(path))
        .count()
}

fn mount_points() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("read mountinfo")
        .lines()
        .filter_map(|line| line.split(' ').nth(4).map(PathBuf::from))
        .collect()
}

/// Runs `program -u` as uid/gid 65534 with no groups: the euid it got,
/// if it could run at all.
fn euid_as_nobody(program: &Path) -> Option<String> {
    let output = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(program)
        .arg("-u")
        .output()
        .expect("setpriv (util-linux)");
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// What a sandbox's root can make in a shared directory: a setuid-root
/// copy of `id` and a character device (`/dev/null`'s numbers, which the
/// test process's device rules allow).
fn plant(dir: &Path) -> (PathBuf, PathBuf) {
    let id = dir.join("id");
    std::fs::copy("/usr/bin/id", &id).expect("copy id");
    std::fs::set_permissions(&id, std::fs::Permissions::from_mode(0o4755)).expect("chmod 4755");
    let device = dir.join("null");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &device,
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    )
    .expect("mknod");
    (id, device)
}

fn nosuid_nodev(path: &Path) -> bool {
    rustix::fs::statvfs(path)
        .expect("statvfs")
        .f_flag
        .contains(StatVfsMountFlags::NOSUID | StatVfsMountFlags::NODEV)
}

/// Audit finding: a sandbox could plant a setuid-root program or a device
/// node on a shared filesystem's host directory, where the runner checked
/// only that the root was a directory.
#[test]
fn a_shared_root_is_made_nosuid_and_nodev_for_the_host() {
    let scratch = Scratch::new();
    let root = scratch.fs().join("shared");
    std::fs::create_dir(&root).expect("the root");
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // A mount beneath the root that its operator made nosuid,nodev, with
    // a file in it: it stays in view.
    let sub = root.join("sub");
    std::fs::create_dir(&sub).expect("sub");
    mount_tmpfs(&sub, "nosuid,nodev,mode=0755");
    std::fs::write(sub.join("kept.txt"), "here").expect("write in the submount");

    let (id, device) = plant(&root);
    assert_eq!(
        euid_as_nobody(&id).as_deref(),
        Some("0"),
        "the attack is real: the planted id runs as root for nobody"
    );
    std::fs::File::open(&device).expect("the planted device opens");

    oci::shared::ensure_host_safe(&root).expect("the root is made safe");
    assert!(nosuid_nodev(&root), "the root is not nosuid,nodev");
    assert_ne!(
        euid_as_nobody(&id).as_deref(),
        Some("0"),
        "an unprivileged host user ran the planted id as root"
    );
    let opened = std::fs::File::open(&device).map(drop);
    assert_eq!(
        opened.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::PermissionDenied),
        "the planted device opens on the host"
    );
    assert_eq!(
        std::fs::read_to_string(sub.join("kept.txt")).expect("the submount is in view"),
        "here"
    );
    // The mount outside the root keeps its flags.
    assert!(!nosuid_nodev(&scratch.fs()));
    // A restart stacks nothing.
    let mounts = mounts_beneath(&scratch.fs());
    oci::shared::ensure_host_safe(&root).expect("again");
    assert_eq!(mounts_beneath(&scratch.fs()), mounts, "a mount was stacked");

    // A mount beneath the root without the flags is refused, named.
    let bare = root.join("bare");
    std::fs::create_dir(&bare).expect("bare");
    mount_tmpfs(&bare, "mode=0755");
    let refused = oci::shared::ensure_host_safe(&root).expect_err("a bare submount");
    let message = refused.to_string();
    assert!(
        message.contains(bare.to_str().expect("utf-8")) && message.contains("nosuid,nodev"),
        "{message}"
    );
}
