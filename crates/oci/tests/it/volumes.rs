//! Home volumes on real btrfs: a sparse image loop-mounted in a temp dir
//! (the temp dir itself is not btrfs), snapshots that keep their instant
//! while the home moves on, re-opening after a runner restart, removal of
//! everything a workload can make, and the plain fallback. They need root
//! and btrfs-progs; every mount is undone by [`Scratch`]'s `Drop`, however
//! the test ends.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use oci::Error;
use oci::volumes::{Backing, HomeVolumes};

/// Sparse: only what btrfs writes takes space. btrfs needs at least
/// 114 MiB.
const IMAGE_BYTES: u64 = 256 << 20;

/// A temp dir holding `root/` and `homes.img`; unmounts whatever is
/// mounted at `root` before the dir is deleted.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Scratch {
        assert!(
            rustix::process::geteuid().is_root(),
            "the home volume tests mount images: they need root (scripts/test.sh runs them as root)"
        );
        assert!(
            Command::new("btrfs").arg("--version").output().is_ok(),
            "btrfs-progs is not installed: apt-get install btrfs-progs"
        );
        let dir = tempfile::Builder::new()
            .prefix("roost-volumes-it-")
            .tempdir()
            .expect("temp dir");
        let magic = rustix::fs::statfs(dir.path()).expect("statfs").f_type;
        assert_ne!(
            i128::from(magic) & 0xFFFF_FFFF,
            i128::from(oci::volumes::BTRFS_SUPER_MAGIC),
            "the temp dir is on btrfs already: these tests need it elsewhere to exercise the image"
        );
        Scratch { dir }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    fn image(&self) -> PathBuf {
        self.dir.path().join("homes.img")
    }

    fn open_image(&self) -> HomeVolumes {
        HomeVolumes::open(&self.root(), Some(&self.image()), IMAGE_BYTES).expect("open with image")
    }

    fn open_plain(&self) -> HomeVolumes {
        HomeVolumes::open(&self.root(), None, 0).expect("open without image")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Whatever the test did, leave no mount and no loop device behind
        // (mount -o loop frees the device at unmount). Lazy as a last
        // resort: a leaked mount outlives the test run.
        let root = self.root();
        for _ in 0..8 {
            if mounts_at(&root) == 0 {
                break;
            }
            let unmounted = Command::new("umount")
                .arg(&root)
                .status()
                .is_ok_and(|s| s.success());
            if !unmounted {
                let _ = Command::new("umount").arg("-l").arg(&root).status();
            }
        }
    }
}

/// How many mounts `/proc/self/mountinfo` has at `path` (the temp paths
/// here have nothing mountinfo escapes).
fn mounts_at(path: &Path) -> usize {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    mountinfo
        .lines()
        .filter(|line| line.split(' ').nth(4) == Some(path.to_str().expect("utf-8 path")))
        .count()
}

/// Runs a tool the way a workload or an operator would, and insists it
/// works.
fn run(program: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("could not run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// The loop device backed by `image` (`/dev/loopN`).
fn loop_device(image: &Path) -> String {
    let listed = run("losetup", &["-j", path_str(image)]);
    let (device, _) = listed
        .split_once(':')
        .unwrap_or_else(|| panic!("no loop device for {}: {listed:?}", image.display()));
    device.to_owned()
}

/// Whether the loop device backed by `image` does direct I/O.
fn loop_is_direct(image: &Path) -> bool {
    let device = loop_device(image);
    let name = device.trim_start_matches("/dev/");
    read(&Path::new("/sys/block").join(name).join("loop/dio")).trim() == "1"
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[test]
fn snapshot_keeps_its_instant_and_is_read_only() {
    let scratch = Scratch::new();
    let volumes = scratch.open_image();
    assert_eq!(
        volumes.backing(),
        &Backing::LoopImage {
            image: std::fs::canonicalize(scratch.image()).expect("image exists"),
            // The temp dir is on a filesystem with O_DIRECT (not btrfs,
            // checked above; ext4 here).
            buffered_because: None,
        }
    );
    assert!(loop_is_direct(&scratch.image()));
    assert!(volumes.can_snapshot());
    assert_eq!(mounts_at(&scratch.root()), 1);

    let home = volumes.create("sbx-1").expect("create home");
    assert_eq!(home, volumes.root().join("homes/sbx-1"));
    std::fs::write(home.join("notes.txt"), "before").expect("write");
    std::fs::create_dir(home.join("src")).expect("mkdir");
    std::fs::write(home.join("src/main.rs"), "fn main() {}").expect("write");

    let snapshot = volumes.snapshot("sbx-1", "save-1").expect("snapshot");
    assert_eq!(snapshot.path, volumes.root().join("snapshots/sbx-1/save-1"));
    assert!(
        snapshot.took < Duration::from_secs(2),
        "a snapshot took {:?}",
        snapshot.took
    );
    assert_eq!(read(&snapshot.path.join("notes.txt")), "before");
    assert_eq!(read(&snapshot.path.join("src/main.rs")), "fn main() {}");

    // The workload moves on; the snapshot does not.
    std::fs::write(home.join("notes.txt"), "after").expect("overwrite");
    std::fs::write(home.join("new.txt"), "new").expect("write");
    std::fs::remove_file(home.join("src/main.rs")).expect("remove");
    assert_eq!(read(&snapshot.path.join("notes.txt")), "before");
    assert_eq!(read(&snapshot.path.join("src/main.rs")), "fn main() {}");
    assert!(!snapshot.path.join("new.txt").exists());
    assert_eq!(read(&home.join("notes.txt")), "after");

    let erofs = Some(rustix::io::Errno::ROFS.raw_os_error());
    let created = std::fs::write(snapshot.path.join("sneaky.txt"), "x");
    assert_eq!(
        created.as_ref().map_err(std::io::Error::raw_os_error),
        Err(erofs),
        "creating a file in the snapshot: {created:?}"
    );
    let modified = std::fs::OpenOptions::new()
        .write(true)
        .open(snapshot.path.join("notes.txt"));
    assert_eq!(
        modified
            .as_ref()
            .map(|_| ())
            .map_err(std::io::Error::raw_os_error),
        Err(erofs),
        "opening a snapshot file for writing"
    );

    assert_eq!(volumes.snapshots("sbx-1").expect("list"), ["save-1"]);
    // A name already taken is an older instant: refused, not reused.
    let again = volumes.snapshot("sbx-1", "save-1");
    assert!(again.is_err(), "{again:?}");
    let second = volumes
        .snapshot("sbx-1", "save-2")
        .expect("second snapshot");
    assert_eq!(read(&second.path.join("notes.txt")), "after");
    assert_eq!(
        volumes.snapshots("sbx-1").expect("list"),
        ["save-1", "save-2"]
    );
    volumes.delete_snapshot("sbx-1", "save-1").expect("delete");
    volumes
        .delete_snapshot("sbx-1", "save-1")
        .expect("delete again");
    assert!(!snapshot.path.exists());
    assert_eq!(volumes.snapshots("sbx-1").expect("list"), ["save-2"]);

    volumes.unmount().expect("unmount");
    assert_eq!(mounts_at(&scratch.root()), 0);
}

#[test]
fn reopening_after_a_restart_reuses_the_mount() {
    let scratch = Scratch::new();
    let volumes = scratch.open_image();
    let home = volumes.create("sbx-keep").expect("create home");
    std::fs::write(home.join("work.txt"), "kept").expect("write");
    volumes.snapshot("sbx-keep", "leftover").expect("snapshot");
    // A runner that stops (or crashes) leaves its mount in place; one of
    // an older runner left its loop device buffered.
    drop(volumes);
    assert_eq!(mounts_at(&scratch.root()), 1);
    run(
        "losetup",
        &["--direct-io=off", &loop_device(&scratch.image())],
    );
    assert!(!loop_is_direct(&scratch.image()));

    let volumes = scratch.open_image();
    assert!(
        matches!(volumes.backing(), Backing::LoopImage { .. }),
        "{:?}",
        volumes.backing()
    );
    assert_eq!(mounts_at(&scratch.root()), 1, "a second mount was stacked");
    let loops = run("losetup", &["-j", path_str(&scratch.image())]);
    assert_eq!(loops.lines().count(), 1, "loop devices: {loops}");
    assert!(loop_is_direct(&scratch.image()), "{:?}", volumes.backing());
    // The existing home is kept as it is, files and all.
    assert_eq!(volumes.create("sbx-keep").expect("create again"), home);
    assert_eq!(read(&home.join("work.txt")), "kept");
    assert_eq!(volumes.snapshots("sbx-keep").expect("list"), ["leftover"]);

    volumes.unmount().expect("unmount");
    assert_eq!(mounts_at(&scratch.root()), 0);
    // The data is in the image, not in the directory under the mount.
    let volumes = scratch.open_image();
    assert_eq!(read(&home.join("work.txt")), "kept");
    volumes.unmount().expect("unmount");
}

#[test]
fn remove_deletes_home_snapshots_and_nested_subvolumes() {
    let scratch = Scratch::new();
    let volumes = scratch.open_image();
    let home = volumes.create("sbx-gone").expect("create home");
    let neighbour = volumes.create("sbx-stays").expect("create neighbour");
    std::fs::write(neighbour.join("mine.txt"), "mine").expect("write");
    volumes
        .snapshot("sbx-stays", "s")
        .expect("neighbour snapshot");

    std::fs::write(home.join("file.txt"), "data").expect("write");
    // What a workload can make in its home without privileges: nested
    // subvolumes (nested again), a read-only snapshot of one, a read-only
    // subvolume holding another, and a subvolume in a plain directory.
    let nested = home.join("nested");
    run("btrfs", &["subvolume", "create", path_str(&nested)]);
    run(
        "btrfs",
        &["subvolume", "create", path_str(&nested.join("deeper"))],
    );
    std::fs::write(nested.join("deeper/file.txt"), "deep").expect("write");
    run(
        "btrfs",
        &[
            "subvolume",
            "snapshot",
            "-r",
            path_str(&nested),
            path_str(&home.join("frozen")),
        ],
    );
    let locked = home.join("locked");
    run("btrfs", &["subvolume", "create", path_str(&locked)]);
    run(
        "btrfs",
        &["subvolume", "create", path_str(&locked.join("inner"))],
    );
    run(
        "btrfs",
        &["property", "set", path_str(&locked), "ro", "true"],
    );
    std::fs::create_dir_all(home.join("a/b")).expect("mkdir");
    run(
        "btrfs",
        &["subvolume", "create", path_str(&home.join("a/b/sub"))],
    );

    let first = volumes.snapshot("sbx-gone", "one").expect("snapshot");
    volumes.snapshot("sbx-gone", "two").expect("snapshot");
    assert_eq!(read(&first.path.join("file.txt")), "data");

    volumes.remove("sbx-gone").expect("remove");
    assert!(!home.exists(), "the home is still there");
    assert!(
        !volumes.root().join("snapshots/sbx-gone").exists(),
        "its snapshots are still there"
    );
    assert!(volumes.snapshots("sbx-gone").expect("list").is_empty());
    // Only the neighbour's subvolumes are left: no junk.
    let left = run("btrfs", &["subvolume", "list", path_str(volumes.root())]);
    let mut left: Vec<&str> = left
        .lines()
        .filter_map(|line| line.split(" path ").nth(1))
        .collect();
    left.sort();
    assert_eq!(left, ["homes/sbx-stays", "snapshots/sbx-stays/s"]);
    assert_eq!(read(&neighbour.join("mine.txt")), "mine");

    volumes.remove("sbx-gone").expect("remove again");
    volumes.remove("never-made").expect("remove what never was");
    volumes.unmount().expect("unmount");
}

#[test]
fn without_btrfs_homes_are_plain_directories() {
    let scratch = Scratch::new();
    let volumes = scratch.open_plain();
    let Backing::Plain { reason } = volumes.backing() else {
        panic!("expected plain homes, got {:?}", volumes.backing());
    };
    assert!(reason.contains("not btrfs"), "reason: {reason}");
    assert!(!volumes.can_snapshot());

    let home = volumes.create("sbx-plain").expect("create home");
    assert!(home.is_dir());
    std::fs::write(home.join("file.txt"), "kept").expect("write");
    volumes.create("sbx-plain").expect("create again");
    assert_eq!(read(&home.join("file.txt")), "kept");

    match volumes.snapshot("sbx-plain", "s") {
        Err(Error::Unsupported(message)) => {
            assert!(message.contains("btrfs"), "message: {message}")
        }
        other => panic!("snapshot of a plain home: {other:?}"),
    }
    assert!(volumes.snapshots("sbx-plain").expect("list").is_empty());
    volumes.remove("sbx-plain").expect("remove");
    assert!(!home.exists());
    volumes.remove("sbx-plain").expect("remove again");
    assert_eq!(mounts_at(&scratch.root()), 0);
}

/// Writes `total` bytes to `path` a MiB at a time; how many went in and
/// the error that stopped it, if one did.
fn write_up_to(path: &Path, total: usize) -> (usize, Option<std::io::Error>) {
    use std::io::Write;
    let mut file = std::fs::File::create(path).expect("create");
    let chunk = vec![7u8; 1 << 20];
    let mut written = 0;
    while written < total {
        match file.write_all(&chunk).and_then(|()| file.sync_data()) {
            Ok(()) => written += chunk.len(),
            Err(e) => return (written, Some(e)),
        }
    }
    (written, None)
}

#[test]
fn a_bounded_home_takes_no_write_past_its_bound_and_deleting_frees_room() {
    let scratch = Scratch::new();
    let volumes = scratch.open_image();
    assert_eq!(
        volumes.unbounded_because(),
        None,
        "the image's quota groups are on"
    );
    let home = volumes.create("sbx-bound").expect("create home");
    volumes.bound("sbx-bound", Some(16 << 20)).expect("bound");

    let edquot = Some(rustix::io::Errno::DQUOT.raw_os_error());
    let (written, stopped) = write_up_to(&home.join("big"), 64 << 20);
    let stopped = stopped.expect("a write past the bound was taken");
    assert_eq!(stopped.raw_os_error(), edquot, "{stopped}");
    assert!(written <= 16 << 20, "{written} bytes went in");

    // A save's snapshot shares the home's blocks and is not counted: the
    // home can be emptied and filled again while it exists.
    volumes.snapshot("sbx-bound", "save-1").expect("snapshot");
    std::fs::remove_file(home.join("big")).expect("delete at the bound");
    let (again, stopped) = write_up_to(&home.join("small"), 8 << 20);
    assert!(stopped.is_none(), "{stopped:?}");
    assert_eq!(again, 8 << 20);

    // The bound is replaced, not added to.
    volumes
        .bound("sbx-bound", Some(64 << 20))
        .expect("bound again");
    let (more, stopped) = write_up_to(&home.join("more"), 32 << 20);
    assert!(stopped.is_none(), "{stopped:?}");
    assert_eq!(more, 32 << 20);

    // Opened again (a restarted runner): the bound is still there.
    drop(volumes);
    let volumes = scratch.open_image();
    assert_eq!(volumes.unbounded_because(), None);
    let (_, stopped) = write_up_to(&home.join("past"), 64 << 20);
    assert_eq!(stopped.and_then(|e| e.raw_os_error()), edquot);
}

/// A sandbox's root layer is a subvolume of its own beside the homes:
/// bounded like a home, apart from it, and removed with `rm -rf` (how
/// the runtime removes a sandbox's files).
#[test]
fn a_root_layer_is_bounded_apart_from_its_home_and_goes_with_rm() {
    let scratch = Scratch::new();
    let volumes = scratch.open_image();
    let layer = volumes
        .create_layer("sbx-layer", Some(16 << 20))
        .expect("create the layer");
    assert_eq!(
        volumes.layer("sbx-layer").expect("path"),
        Some(layer.clone())
    );
    assert!(layer.starts_with(volumes.root().join("roots")), "{layer:?}");
    let home = volumes.create("sbx-layer").expect("create home");

    let edquot = Some(rustix::io::Errno::DQUOT.raw_os_error());
    std::fs::create_dir_all(layer.join("rootfs/opt")).expect("mkdir");
    let (written, stopped) = write_up_to(&layer.join("rootfs/opt/big"), 64 << 20);
    assert_eq!(stopped.and_then(|e| e.raw_os_error()), edquot);
    assert!(written <= 16 << 20, "{written} bytes went in");
    // The home is not the layer: it takes writes the layer would not.
    let (in_home, stopped) = write_up_to(&home.join("file"), 24 << 20);
    assert!(stopped.is_none(), "{stopped:?}");
    assert_eq!(in_home, 24 << 20);

    // Made again (a launch after a restart): the files stay, the bound
    // is the new one; `None` lifts it.
    volumes
        .create_layer("sbx-layer", Some(48 << 20))
        .expect("again");
    assert!(layer.join("rootfs/opt/big").exists());
    let (_, stopped) = write_up_to(&layer.join("rootfs/more"), 16 << 20);
    assert!(stopped.is_none(), "{stopped:?}");
    volumes.create_layer("sbx-layer", None).expect("unbounded");
    let (_, stopped) = write_up_to(&layer.join("rootfs/past"), 48 << 20);
    assert!(stopped.is_none(), "{stopped:?}");

    oci::host::remove_tree(&layer).expect("rm -rf the subvolume");
    assert!(!layer.exists());
}

#[test]
fn a_plain_home_cannot_be_bounded_and_says_why() {
    let scratch = Scratch::new();
    let volumes = scratch.open_plain();
    let reason = volumes
        .unbounded_because()
        .expect("plain homes cannot be bounded");
    assert!(reason.contains("plain directories"), "{reason}");
    volumes.create("sbx-plain").expect("create home");
    match volumes.bound("sbx-plain", Some(16 << 20)) {
        Err(Error::Unsupported(message)) => assert_eq!(message, reason),
        other => panic!("a bound on a plain home: {other:?}"),
    }
    // Nor has a root layer a place of its own there.
    assert_eq!(volumes.layer("sbx-plain").expect("a valid id"), None);
    assert!(matches!(
        volumes.create_layer("sbx-plain", None),
        Err(Error::Unsupported(_))
    ));
}

#[test]
fn unsafe_ids_and_names_are_refused() {
    let scratch = Scratch::new();
    let volumes = scratch.open_plain();
    volumes.create("ok").expect("create");
    let invalid = |what: &str, result: oci::Result<()>| {
        assert!(
            matches!(result, Err(Error::Invalid(_))),
            "{what}: {result:?}"
        );
    };
    for bad in ["..", ".", "a/b", "", ".hidden", "a b", "../ok"] {
        invalid(bad, volumes.home(bad).map(drop));
        invalid(bad, volumes.create(bad).map(drop));
        invalid(bad, volumes.layer(bad).map(drop));
        invalid(bad, volumes.snapshot(bad, "s").map(drop));
        invalid(bad, volumes.snapshot("ok", bad).map(drop));
        invalid(bad, volumes.snapshots(bad).map(drop));
        invalid(bad, volumes.delete_snapshot("ok", bad));
        invalid(bad, volumes.delete_snapshot(bad, "s"));
        invalid(bad, volumes.remove(bad));
    }
    assert!(volumes.home(&"x".repeat(128)).is_ok());
    invalid("129 bytes", volumes.home(&"x".repeat(129)).map(drop));
    // Nothing was made or removed by the refused calls.
    assert!(volumes.root().join("homes/ok").is_dir());
    let homes: Vec<_> = std::fs::read_dir(volumes.root().join("homes"))
        .expect("list homes")
        .map(|entry| entry.expect("entry").file_name())
        .collect();
    assert_eq!(homes, ["ok"]);
}

#[test]
fn image_is_not_mounted_over_a_non_empty_root() {
    let scratch = Scratch::new();
    std::fs::create_dir(scratch.root()).expect("mkdir root");
    std::fs::write(scratch.root().join("precious.txt"), "here").expect("write");

    match HomeVolumes::open(&scratch.root(), Some(&scratch.image()), IMAGE_BYTES) {
        Err(Error::Unsupported(message)) => {
            assert!(message.contains("not empty"), "message: {message}")
        }
        other => panic!("open over a non-empty root: {other:?}"),
    }
    assert_eq!(mounts_at(&scratch.root()), 0);
    assert!(!scratch.image().exists(), "the image was made anyway");
    assert_eq!(read(&scratch.root().join("precious.txt")), "here");
}

/// The per-mount options of the last mount at `path`, as mountinfo shows
/// them.
fn mount_options(path: &Path) -> Vec<String> {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    mountinfo
        .lines()
        .rfind(|line| line.split(' ').nth(4) == Some(path.to_str().expect("utf-8 path")))
        .and_then(|line| line.split(' ').nth(5))
        .map(|options| options.split(',').map(str::to_owned).collect())
        .unwrap_or_default()
}

fn assert_nosuid_nodev(path: &Path) {
    let options = mount_options(path);
    for wanted in ["nosuid", "nodev"] {
        assert!(
            options.iter().any(|o| o == wanted),
            "the home volume at {} is mounted without {wanted}: {options:?}",
            path.display()
        );
    }
}

/// Issue 14: a sandbox's `chmod 4755` in its home made a setuid-root file
/// on the host's home volume. The volume is `nosuid,nodev` whether the
/// runner mounts it or finds it mounted without them (by a runner from
/// before the fix), and a remount stacks nothing.
#[test]
fn the_home_volume_is_nosuid_and_nodev_even_when_found_mounted_without() {
    let scratch = Scratch::new();
    let volumes = scratch.open_image();
    assert_nosuid_nodev(&scratch.root());
    volumes.unmount().expect("unmount");

    run(
        "mount",
        &[
            "-t",
            "btrfs",
            "-o",
            "loop",
            path_str(&scratch.image()),
            path_str(&scratch.root()),
        ],
    );
    assert!(
        !mount_options(&scratch.root()).contains(&"nosuid".to_owned()),
        "the old-style mount is the case under test"
    );
    let volumes = scratch.open_image();
    assert!(matches!(volumes.backing(), Backing::LoopImage { .. }));
    assert_nosuid_nodev(&scratch.root());
    assert_eq!(mounts_at(&scratch.root()), 1, "a mount was stacked");
    volumes.unmount().expect("unmount");
    assert_eq!(mounts_at(&scratch.root()), 0);
}
