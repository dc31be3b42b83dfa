//! Hostile archives: nothing may be written, changed or removed outside the
//! destination, and host files may not be pulled in.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

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
