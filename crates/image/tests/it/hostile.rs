//! Hostile archives: nothing may be written, changed or removed outside the
//! destination, and host files may not be pulled in.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use image::Error;

use crate::{Member, Workspace, ok, tar, tree};

/// Everything in the workspace outside `scratch`, to compare before and
/// after.
pub(crate) fn outside_state(workspace: &Workspace) -> Vec<String> {
    let mut state = tree(&workspace.outside());
    let mode = fs::metadata(workspace.outside())
        .expect("outside")
        .permissions()
        .mode();
    state.push(format!("outside mode {:o}", mode & 0o7777));
    let mut top: Vec<_> = fs::read_dir(workspace.dir.path())
        .expect("workspace")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name != "source.bin")
        .collect();
    top.sort();
    state.extend(top);
    state
}

pub(crate) fn seed_outside(workspace: &Workspace) {
    fs::write(workspace.outside().join("victim"), "precious").expect("victim");
    fs::create_dir(workspace.outside().join("dir")).expect("dir");
    fs::write(workspace.outside().join("dir/child"), "precious").expect("child");
    fs::set_permissions(workspace.outside(), fs::Permissions::from_mode(0o700)).expect("chmod");
}

#[test]
fn rootfs_members_stay_inside() {
    let workspace = Workspace::new();
    seed_outside(&workspace);
    let before = outside_state(&workspace);
    let outside = workspace.outside();
    let outside = outside.to_str().expect("utf-8 temp path");
    let victim = format!("{outside}/victim");
    let bytes = tar(&[
        Member::File("../evil", b"evil", 0o644),
        Member::File("a/../../evil", b"evil", 0o644),
        Member::File("/abs", b"made relative", 0o644),
        // A symlink out, then members through it: resolved inside the root.
        Member::Symlink("link", outside),
        Member::File("link/evil", b"confined", 0o644),
        Member::Dir("link/sub/", 0o777),
        // A relative symlink climbing past the root is clamped at the root.
        Member::Symlink("up", "../../../../../.."),
        Member::File("up/clamped", b"at the root", 0o644),
        // A symlink to a host file, then a file of the same name: the file
        // replaces the symlink instead of writing through it.
        Member::Symlink("over", &victim),
        Member::File("over", b"replaced", 0o644),
        // Same for a directory entry over a symlink to a host directory.
        Member::Symlink("dirlink", outside),
        Member::Dir("dirlink/", 0o777),
        // Hard links may not climb out.
        Member::Hardlink("hard", "../../outside/victim"),
    ]);
    let (root, report) = ok(workspace.unpack(&bytes));
    assert_eq!(outside_state(&workspace), before);
    let inside = format!("{}/", outside.trim_start_matches('/'));
    let mut expected = vec![
        r#"abs 644 "made relative""#.to_owned(),
        "dirlink/ 777".to_owned(),
        format!("link -> {outside}"),
        r#"over 644 "replaced""#.to_owned(),
        "up -> ../../../../../..".to_owned(),
    ];
    // `link/evil` landed at `<root><outside>/evil`, with the parents made.
    let mut path = String::new();
    for part in inside.trim_end_matches('/').split('/') {
        path.push_str(part);
        expected.push(format!("{path}/ 755"));
        path.push('/');
    }
    expected.push(format!(r#"{path}evil 644 "confined""#));
    expected.push(format!("{path}sub/ 777"));
    expected.push(r#"clamped 644 "at the root""#.to_owned());
    expected.sort();
    let mut actual = tree(&root);
    actual.sort();
    assert_eq!(actual, expected);
    assert_eq!(report.skipped_unsafe, 3);
}

#[test]
fn hard_link_to_a_host_path_is_refused() {
    let workspace = Workspace::new();
    seed_outside(&workspace);
    let victim = workspace.outside().join("victim");
    let victim = victim.to_str().expect("utf-8 temp path");
    let bytes = tar(&[Member::Hardlink("shadow", victim)]);
    let error = workspace.unpack(&bytes).expect_err("absolute hard link");
    assert!(matches!(error, Error::Malformed(_)), "{error}");
    assert!(
        error.to_string().contains("hard link to missing"),
        "{error}"
    );
    let victim = fs::metadata(workspace.outside().join("victim")).expect("victim");
    assert_eq!(victim.nlink(), 1, "no link was made to the host file");
    assert!(!workspace.scratch().join(".archive/shadow").exists());
}

#[test]
fn whiteouts_do_not_reach_out() {
    let workspace = Workspace::new();
    seed_outside(&workspace);
    let before = outside_state(&workspace);
    let outside = workspace.outside();
    let outside = outside.to_str().expect("utf-8 temp path");
    let lower = tar(&[
        Member::Symlink("escape", outside),
        Member::Symlink("escape2", outside),
        Member::Symlink("escape3", outside),
        Member::Dir("d/", 0o755),
        Member::File("d/f", b"kept", 0o644),
    ]);
    let upper = tar(&[
        // Through a symlink to the host: resolved inside the root, where
        // there is nothing to remove.
        Member::File("escape/.wh.victim", b"", 0o644),
        Member::File("escape/dir/.wh..wh..opq", b"", 0o644),
        // An opaque marker inside a symlink replaces the symlink only.
        Member::File("escape3/.wh..wh..opq", b"", 0o644),
        // Whiting out a symlink removes the symlink, not its target.
        Member::File(".wh.escape2", b"", 0o644),
        // `.wh..` would name the parent directory.
        Member::File("d/.wh..", b"", 0o644),
        Member::File("d/.wh...", b"", 0o644),
    ]);
    let manifest = r#"[{"Layers":["lower.tar","upper.tar"]}]"#;
    let archive = tar(&[
        Member::File("lower.tar", &lower, 0o644),
        Member::File("upper.tar", &upper, 0o644),
        Member::File("manifest.json", manifest.as_bytes(), 0o644),
    ]);
    let (root, report) = ok(workspace.unpack(&archive));
    assert_eq!(outside_state(&workspace), before);
    assert_eq!(
        tree(&root),
        [
            "d/ 755".to_owned(),
            r#"d/f 644 "kept""#.to_owned(),
            format!("escape -> {outside}"),
        ]
    );
    assert_eq!(report.whiteouts, 4);
    assert_eq!(report.skipped_unsafe, 2);
}

#[test]
fn blob_paths_may_not_leave_the_archive() {
    for layer in [
        "../layer.tar",
        "/etc/hostname",
        "link/layer.tar",
        "self/layer.tar",
    ] {
        let workspace = Workspace::new();
        fs::write(workspace.outside().join("layer.tar"), tar(&[])).expect("host tar");
        let outside = workspace.outside();
        let manifest = format!(r#"[{{"Layers":["{layer}"]}}]"#);
        let archive = tar(&[
            Member::Symlink("link", outside.to_str().expect("utf-8 temp path")),
            Member::Symlink("self", "../../outside"),
            Member::File("manifest.json", manifest.as_bytes(), 0o644),
        ]);
        let error = workspace.unpack(&archive).expect_err(layer);
        let message = error.to_string();
        assert!(matches!(error, Error::Malformed(_)), "{layer}: {message}");
        assert!(
            message.contains("escapes the archive"),
            "{layer}: {message}"
        );
    }
}

/// Sets a base-256 tar number: the high bit of the first byte says so, the
/// value is big-endian in the field's last 8 bytes.
fn base256(field: &mut [u8], value: u64) {
    field.fill(0);
    let start = field.len() - 8;
    field[start..].copy_from_slice(&value.to_be_bytes());
    field[0] |= 0x80;
}

/// A tar of one GNU sparse member (typeflag `S`) with no data in the
/// archive, whose sparse map claims one 2^62-byte hole, written byte by
/// byte: the `tar` crate reads it as 2^62 zeros.
fn sparse_hole_tar(name: &str) -> Vec<u8> {
    const HOLE_BYTES: u64 = 1 << 62;
    let mut header = [0u8; 512];
    header[..name.len()].copy_from_slice(name.as_bytes());
    header[100..108].copy_from_slice(b"0000644\0"); // mode
    header[108..116].copy_from_slice(b"0000000\0"); // uid
    header[116..124].copy_from_slice(b"0000000\0"); // gid
    header[124..136].copy_from_slice(b"00000000000\0"); // size: no data
    header[136..148].copy_from_slice(b"00000000000\0"); // mtime
    header[156] = b'S';
    header[257..265].copy_from_slice(b"ustar  \0"); // GNU magic and version
    // The first sparse entry: the data starts at 2^62, and is 0 bytes.
    base256(&mut header[386..398], HOLE_BYTES);
    header[398..410].copy_from_slice(b"00000000000\0");
    base256(&mut header[483..495], HOLE_BYTES); // realsize
    // The checksum counts its own field as spaces.
    header[148..156].fill(b' ');
    let sum: u32 = header.iter().map(|&byte| u32::from(byte)).sum();
    header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    let mut archive = header.to_vec();
    archive.extend_from_slice(&[0; 1024]); // the end of the archive
    archive
}

/// Regression: a GNU sparse member claiming a 2^62-byte hole was read as
/// 2^62 zeros. Skipped (a `../x` name, or any member in a layer's whiteout
/// pass) it spun for ever; written, it filled the disk. It is refused, by
/// name, whatever its name and wherever it is.
#[test]
fn a_gnu_sparse_member_is_refused_not_expanded() {
    // Generous: each case takes milliseconds, on a busy machine too.
    const DEADLINE: Duration = Duration::from_secs(30);
    let image = |upper: &[u8]| {
        let lower = tar(&[Member::File("kept", b"kept", 0o644)]);
        let manifest = r#"[{"Layers":["lower.tar","upper.tar"]}]"#;
        tar(&[
            Member::File("lower.tar", &lower, 0o644),
            Member::File("upper.tar", upper, 0o644),
            Member::File("manifest.json", manifest.as_bytes(), 0o644),
        ])
    };
    let cases = [
        (
            "root-filesystem tar, safe name",
            sparse_hole_tar("big"),
            "big",
            "",
        ),
        (
            "root-filesystem tar, `../x`",
            sparse_hole_tar("../x"),
            "../x",
            "",
        ),
        (
            "later layer, safe name",
            image(&sparse_hole_tar("big")),
            "big",
            "upper.tar",
        ),
        (
            "later layer, `../x`",
            image(&sparse_hole_tar("../x")),
            "../x",
            "upper.tar",
        ),
    ];
    // All at once, so that a hang reports every case that hangs.
    let pending: Vec<_> = cases
        .into_iter()
        .map(|(case, bytes, name, archive)| {
            let (done, result) = mpsc::channel();
            std::thread::spawn(move || {
                let workspace = Workspace::new();
                // The receiver is gone only if the test already failed.
                let _ = done.send(workspace.unpack(&bytes).map(|(_, report)| report));
            });
            (case, name, archive, result)
        })
        .collect();
    let started = Instant::now();
    for (case, name, archive, result) in pending {
        let left = DEADLINE.saturating_sub(started.elapsed());
        let error = match result.recv_timeout(left) {
            Ok(Err(error)) => error,
            Ok(Ok(report)) => panic!("{case}: unpacked: {report:?}"),
            Err(_) => panic!("{case}: still unpacking after {DEADLINE:?}"),
        };
        let message = error.to_string();
        assert!(matches!(error, Error::Unsupported(_)), "{case}: {message}");
        assert!(
            message.contains(&format!("member {name} is a GNU sparse file")),
            "{case}: {message}"
        );
        assert!(message.contains(archive), "{case}: {message}");
    }
}
