//! Directories and root-filesystem tars.

use std::fs;
use std::os::unix::fs::MetadataExt;

use image::{Error, SourceKind, UnpackReport};

use crate::{Member, Workspace, gzip, ok, tar, tree, zstd};

fn rootfs_members() -> Vec<Member<'static>> {
    vec![
        Member::Dir("./", 0o755),
        Member::Dir("./etc/", 0o755),
        Member::File("./etc/hostname", b"box\n", 0o644),
        Member::Dir("./tmp/", 0o1777),
        Member::Dir("./usr/bin/", 0o755),
        Member::File("./usr/bin/su", b"#!", 0o4755),
        Member::File("./usr/bin/wall", b"#!", 0o2755),
        Member::Hardlink("./usr/bin/su2", "./usr/bin/su"),
        Member::Symlink("./bin", "usr/bin"),
        // Written through the relative symlink just made.
        Member::File("./bin/sh", b"shell", 0o755),
        // `.wh.` is only special in image layers.
        Member::File("./.wh.kept", b"", 0o600),
    ]
}

fn rootfs_tree() -> Vec<String> {
    [
        r#".wh.kept 600 """#,
        "bin -> usr/bin",
        "etc/ 755",
        r#"etc/hostname 644 "box\n""#,
        "tmp/ 1777",
        "usr/ 755",
        "usr/bin/ 755",
        r#"usr/bin/sh 755 "shell""#,
        // setuid and setgid dropped.
        r##"usr/bin/su 755 "#!""##,
        r##"usr/bin/su2 755 "#!""##,
        r##"usr/bin/wall 755 "#!""##,
    ]
    .map(String::from)
    .to_vec()
}

fn check_rootfs(bytes: &[u8]) {
    let workspace = Workspace::new();
    let (root, report) = ok(workspace.unpack(bytes));
    assert_eq!(root, workspace.scratch().join("rootfs"));
    assert_eq!(tree(&root), rootfs_tree());
    assert_eq!(
        report,
        UnpackReport {
            kind: SourceKind::Tar,
            layers: 1,
            images_in_archive: 0,
            entries: 11,
            skipped_special: 0,
            skipped_unsafe: 0,
            whiteouts: 0,
        }
    );
    let su = fs::metadata(root.join("usr/bin/su")).expect("su");
    let su2 = fs::metadata(root.join("usr/bin/su2")).expect("su2");
    assert_eq!(su.ino(), su2.ino(), "a hard link, not a copy");
    assert_eq!(su.mtime(), 1_700_000_000);
    // Nothing else is left in scratch.
    let left: Vec<_> = fs::read_dir(workspace.scratch())
        .expect("scratch")
        .map(|entry| entry.expect("entry").file_name())
        .collect();
    assert_eq!(left, ["rootfs"]);
}

#[test]
fn directory_is_used_in_place() {
    let workspace = Workspace::new();
    let source = workspace.dir.path().join("tree");
    fs::create_dir(&source).expect("mkdir");
    fs::write(source.join("file"), "x").expect("write");
    let (root, report) = ok(image::unpack(&source, &workspace.scratch()));
    assert_eq!(root, source);
    assert_eq!(report.kind, SourceKind::Directory);
    assert_eq!(report.layers, 0);
    assert_eq!(
        fs::read_dir(workspace.scratch()).expect("scratch").count(),
        0
    );
}

#[test]
fn plain_rootfs_tar() {
    check_rootfs(&tar(&rootfs_members()));
}

#[test]
fn gzip_rootfs_tar() {
    check_rootfs(&gzip(&tar(&rootfs_members())));
}

#[test]
fn zstd_rootfs_tar() {
    check_rootfs(&zstd(&tar(&rootfs_members())));
}

#[test]
fn device_nodes_and_fifos_are_skipped_and_counted() {
    let workspace = Workspace::new();
    let bytes = tar(&[
        Member::Dir("dev/", 0o755),
        Member::CharDevice("dev/null"),
        Member::Fifo("dev/initctl"),
        Member::File("dev/.keep", b"", 0o644),
    ]);
    let (root, report) = ok(workspace.unpack(&bytes));
    assert_eq!(tree(&root), ["dev/ 755", r#"dev/.keep 644 """#]);
    assert_eq!(report.skipped_special, 2);
    assert_eq!(report.entries, 4);
}

#[test]
fn scratch_must_be_empty() {
    let workspace = Workspace::new();
    fs::write(workspace.scratch().join("old"), "x").expect("write");
    let error = workspace
        .unpack(&tar(&rootfs_members()))
        .expect_err("not empty");
    assert!(matches!(error, Error::ScratchNotEmpty(_)), "{error}");
}

#[test]
fn truncated_tar_is_an_archive_error() {
    let workspace = Workspace::new();
    let bytes = tar(&[Member::File("big", &[7u8; 4096], 0o644)]);
    // Cut inside the data, at a block boundary, where the `tar` crate would
    // otherwise see a clean end of archive.
    let error = workspace.unpack(&bytes[..1024]).expect_err("truncated");
    assert!(matches!(error, Error::Archive { .. }), "{error}");
    assert!(error.to_string().contains("truncated"), "{error}");
}

#[test]
fn corrupt_gzip_is_an_archive_error() {
    let workspace = Workspace::new();
    let mut bytes = gzip(&tar(&rootfs_members()));
    let middle = bytes.len() / 2;
    bytes.truncate(middle);
    let error = workspace.unpack(&bytes).expect_err("cut gzip");
    assert!(matches!(error, Error::Archive { .. }), "{error}");
    assert!(!error.to_string().contains('\n'), "one line: {error}");
}

#[test]
fn xz_is_unsupported() {
    let workspace = Workspace::new();
    let error = workspace
        .unpack(b"\xfd7zXZ\x00\x00\x04rest")
        .expect_err("xz");
    assert!(matches!(error, Error::Unsupported(_)), "{error}");
}

#[test]
fn oversized_tar_headers_are_refused() {
    let workspace = Workspace::new();
    let comment = vec![b'a'; (image::HEADER_BYTES_MAX + 1024) as usize];
    let bytes = gzip(&tar(&[
        Member::Pax("comment", comment),
        Member::File("file", b"x", 0o644),
    ]));
    let error = workspace.unpack(&bytes).expect_err("huge pax header");
    assert!(matches!(error, Error::Archive { .. }), "{error}");
    assert!(error.to_string().contains("exceed"), "{error}");
}

/// Directories and symlinks carry the archive's times, not the time of
/// unpacking: the same archive gives the same tree (and store root) every
/// time it is imported.
#[test]
fn directory_and_symlink_times_come_from_the_archive() {
    let bytes = tar(&rootfs_members());
    let first = Workspace::new();
    let (root, _) = ok(first.unpack(&bytes));
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let second = Workspace::new();
    let (again, _) = ok(second.unpack(&bytes));
    // (`usr` has no member of its own: it gets the time it was made.)
    for path in ["etc", "usr/bin", "bin"] {
        let a = fs::symlink_metadata(root.join(path)).expect("first");
        let b = fs::symlink_metadata(again.join(path)).expect("second");
        assert_eq!(a.mtime(), b.mtime(), "{path}");
        let archive_mtime = 1_700_000_000;
        assert_eq!(a.mtime(), archive_mtime, "{path} has the unpacking time");
    }
}
