//! Imported images: the sandbox's root is the image (read-only lower
//! layer) under its own writable layer, and the host's init still runs as
//! PID 1 although the image has no C library at all.

use std::path::Path;

use oci::{Limits, RootImage};

use crate::support::{TestSandbox, prepare};

/// A root filesystem with nothing but a static busybox and its applets
/// (Debian's busybox-static, which scripts/test.sh installs): no libc, no
/// dynamic loader, nothing of the host.
pub fn busybox_image(dir: &Path) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("bin");
    std::fs::create_dir_all(dir.join("etc")).expect("etc");
    std::fs::copy("/bin/busybox", bin.join("busybox"))
        .expect("/bin/busybox (apt-get install busybox-static)");
    let list = std::process::Command::new("/bin/busybox")
        .arg("--list")
        .output()
        .expect("busybox --list");
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", bin.join(applet)).expect("applet link");
        }
    }
    std::fs::write(dir.join("etc/os-release"), "ID=roost-busybox\n").expect("os-release");
}

fn mounted(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .any(|line| line.split(' ').nth(4) == Some(path.to_str().expect("utf-8 path")))
}

#[tokio::test]
async fn an_imported_image_is_the_root_under_the_sandboxs_own_layer() {
    let (dir, mut config) = prepare("image", Limits::default());
    let image = dir.path().join("image");
    busybox_image(&image);
    config.image = RootImage::Tree(image.clone());
    let rootfs = config.paths.rootfs();
    let t = TestSandbox::start_config(dir, config).await;

    // The image's files, not the host's: no host libc, the image's os-release.
    assert_eq!(t.sh_ok("cat /etc/os-release").await, "ID=roost-busybox\n");
    let host_libc = t.sh("ls /usr/lib/x86_64-linux-gnu/libc.so.6 /lib64").await;
    assert_ne!(
        host_libc.end.outcome,
        oci::Outcome::Exited { code: 0 },
        "the host's system is visible: {}",
        host_libc.stdout
    );

    // The host's init is PID 1, through the host's loader.
    let cmdline = t.sh_ok("tr '\\0' ' ' < /proc/1/cmdline").await;
    assert_eq!(
        cmdline.trim(),
        "/.roost/ld.so --library-path /.roost/lib /.roost/init --agent-fd 3"
    );
    assert_eq!(
        t.sh_ok("echo \"$HOME\"; pwd").await,
        "/workspace\n/workspace\n"
    );

    // Writes land in the sandbox's layer; the image stays as imported.
    t.sh_ok("echo changed > /etc/os-release; mkdir -p /opt/tool && echo 1 > /opt/tool/v")
        .await;
    assert_eq!(t.sh_ok("cat /etc/os-release").await, "changed\n");
    assert_eq!(
        std::fs::read_to_string(image.join("etc/os-release")).expect("image file"),
        "ID=roost-busybox\n"
    );
    assert!(!image.join("opt").exists(), "a write reached the image");
    let upper = t.config.paths.upper();
    assert_eq!(
        std::fs::read_to_string(upper.join("etc/os-release")).expect("upper file"),
        "changed\n"
    );
    assert!(
        mounted(&rootfs),
        "the overlay is not mounted at {}",
        rootfs.display()
    );

    // Deleting the container unmounts the overlay; a new life mounts it
    // again over the same layer (standard storage keeps it).
    t.sandbox.delete().await.expect("delete");
    assert!(!mounted(&rootfs), "the overlay outlived its container");
    let again = t.runtime.launch(&t.config).await.expect("relaunch");
    let ran = {
        let mut out = Vec::new();
        again
            .run(
                &oci::CommandSpec::new(["cat", "/opt/tool/v", "/etc/os-release"]),
                |_, bytes| out.extend_from_slice(bytes),
            )
            .await
            .expect("runs");
        String::from_utf8_lossy(&out).into_owned()
    };
    assert_eq!(ran, "1\nchanged\n");
    again.remove_files().await.expect("remove files");
    assert!(!mounted(&rootfs));
    assert!(!t.config.paths.dir().exists());
}
