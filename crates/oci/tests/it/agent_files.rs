//! The agent's file operations (`oci::agent::files`) in real sandboxes:
//! uploads and downloads (whole, in ranges, on a full disk, abandoned),
//! listings, removal, moves, directories, tar streams both ways, and what
//! symlinks, hostile tars and bad paths cannot make them do.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use oci::agent::wire::{self, kind};
use oci::{AgentDownload, Error, FileKind, Limits, Sandbox};

use crate::support::{TestSandbox, eventually, init_pid, prepare, process_alive};

/// Deterministic bytes that do not compress or repeat (xorshift).
fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

/// The agent's code of a refusal.
fn code<T>(result: oci::Result<T>) -> String {
    match result {
        Err(Error::Agent { code, .. }) => code,
        Err(other) => panic!("not the agent's refusal: {other}"),
        Ok(_) => panic!("accepted"),
    }
}

async fn read_all(mut download: AgentDownload) -> oci::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    while let Some(chunk) = download.next_chunk().await? {
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

async fn read_file(sandbox: &Sandbox, path: &str) -> oci::Result<Vec<u8>> {
    let (_, download) = sandbox.agent_read_file(path, 0, None).await?;
    read_all(download).await
}

/// Uploads `content` in 1 MiB writes, as a server relaying a body would.
async fn write_file(
    sandbox: &Sandbox,
    path: &str,
    content: &[u8],
    mode: Option<u32>,
    parents: bool,
) -> oci::Result<u64> {
    let mut writer = sandbox.agent_write_file(path, mode, parents).await?;
    for part in content.chunks(1024 * 1024) {
        writer.write(part).await?;
    }
    writer.finish().await
}

async fn tar_write(sandbox: &Sandbox, path: &str, tar: &[u8]) -> oci::Result<oci::TarSummary> {
    let mut writer = sandbox.agent_tar_write(path).await?;
    for part in tar.chunks(100_000) {
        writer.write(part).await?;
    }
    writer.finish().await
}

/// Names in `dir` (on the host) that are upload leftovers.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with(oci::agent::files::UPLOAD_PREFIX))
                .collect()
        })
        .unwrap_or_default()
}

/// A process's resident memory, from the host's /proc.
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

fn mode_of(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .mode()
        & 0o7777
}

#[tokio::test]
async fn a_50_mib_file_round_trips_with_its_mode_and_replaces_the_old_one_whole() {
    let t = TestSandbox::start("files-big", Limits::default()).await;
    let sandbox = &t.sandbox;
    let content = pseudo_random(50 * 1024 * 1024, 1);

    let started = Instant::now();
    let size = write_file(sandbox, "deep/er/big.bin", &content, Some(0o640), true)
        .await
        .expect("uploaded");
    let upload = started.elapsed();
    assert_eq!(size, content.len() as u64);
    let host = t.workspace.join("deep/er/big.bin");
    assert!(std::fs::read(&host).expect("on the host") == content);
    assert_eq!(mode_of(&host), 0o640);
    assert_eq!(mode_of(&t.workspace.join("deep/er")), 0o755, "parents 0755");
    assert!(leftovers(&t.workspace.join("deep/er")).is_empty());

    let init_pid = init_pid(sandbox).await;
    let rss_before = rss_kib(init_pid);
    let started = Instant::now();
    let (info, download) = sandbox
        .agent_read_file("/workspace/deep/er/big.bin", 0, None)
        .await
        .expect("download");
    assert_eq!(
        (info.size, info.mode, info.kind),
        (content.len() as u64, 0o640, FileKind::File)
    );
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    assert!((now_ms - info.mtime_unix_ms).abs() < 600_000, "{info:?}");
    // The file work runs beside the command service, never in its way:
    // a command runs while the download waits half read. And a reader
    // that stops reading holds the agent back (a few chunks buffered, not
    // the file): its memory stays flat.
    let mut download = download;
    let mut back = download
        .next_chunk()
        .await
        .expect("a chunk")
        .expect("bytes");
    assert_eq!(t.sh_ok("echo meanwhile").await, "meanwhile\n");
    let mut samples = Vec::new();
    for _ in 0..25 {
        samples.push(rss_kib(init_pid));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let most = samples.iter().copied().max().unwrap_or(0);
    assert!(
        most < rss_before + 16 * 1024,
        "the agent grew from {rss_before} KiB to {most} KiB while its reader paused"
    );
    back.extend(read_all(download).await.expect("all bytes"));
    let download = started.elapsed();
    assert!(back == content, "the download differs");
    eprintln!("50 MiB: upload {upload:?}, download {download:?}");

    // Written again: the new content whole, setuid and setgid never kept.
    let smaller = pseudo_random(3 * 1024 * 1024 + 17, 2);
    write_file(sandbox, "deep/er/big.bin", &smaller, Some(0o6755), false)
        .await
        .expect("replaced");
    assert!(std::fs::read(&host).expect("on the host") == smaller);
    assert_eq!(mode_of(&host), 0o755);
    // No mode: 0644.
    write_file(sandbox, "/workspace/plain.txt", b"plain\n", None, false)
        .await
        .expect("written");
    assert_eq!(mode_of(&t.workspace.join("plain.txt")), 0o644);
    assert!(leftovers(&t.workspace.join("deep/er")).is_empty());
    assert!(leftovers(&t.workspace).is_empty());
}

#[tokio::test]
async fn partial_reads_answer_the_range_asked_and_refuse_what_is_not_a_file() {
    let t = TestSandbox::start("files-range", Limits::default()).await;
    let sandbox = &t.sandbox;
    let content = pseudo_random(200_000, 3);
    std::fs::write(t.workspace.join("data.bin"), &content).expect("host write");
    std::fs::create_dir(t.workspace.join("dir")).expect("host dir");

    let cases: [(u64, Option<u64>, std::ops::Range<usize>); 6] = [
        (100, Some(50), 100..150),
        (0, Some(1), 0..1),
        (199_990, None, 199_990..200_000),
        (150_000, Some(1_000_000), 150_000..200_000),
        (200_000, None, 200_000..200_000),
        (65_000, Some(70_000), 65_000..135_000),
    ];
    for (offset, length, range) in cases {
        let (info, download) = sandbox
            .agent_read_file("data.bin", offset, length)
            .await
            .expect("download");
        assert_eq!(info.size, 200_000, "the whole size, whatever the range");
        let bytes = read_all(download).await.expect("bytes");
        assert!(
            bytes == content[range.clone()],
            "offset {offset} length {length:?}: {} bytes",
            bytes.len()
        );
    }
    assert_eq!(
        code(sandbox.agent_read_file("data.bin", 200_001, None).await),
        "offset_past_end"
    );
    assert_eq!(
        code(sandbox.agent_read_file("dir", 0, None).await),
        "is_a_directory"
    );
    assert_eq!(
        code(sandbox.agent_read_file("missing.bin", 0, None).await),
        "not_found"
    );
    // A fifo would block a reader forever: refused, the agent unblocked.
    t.sh_ok("mkfifo /workspace/fifo").await;
    assert_eq!(
        code(sandbox.agent_read_file("fifo", 0, None).await),
        "bad_request"
    );
    // Out of the workspace: the sandbox's own root.
    let passwd = read_file(sandbox, "/etc/passwd").await.expect("read");
    assert_eq!(
        passwd,
        t.sh_ok("cat /etc/passwd").await.into_bytes(),
        "absolute paths are the sandbox's"
    );
}

#[tokio::test]
async fn a_listing_goes_to_its_depth_and_reports_a_symlink_without_following_it() {
    let t = TestSandbox::start("files-list", Limits::default()).await;
    let sandbox = &t.sandbox;
    let tree = t.workspace.join("tree");
    std::fs::create_dir_all(tree.join("a/b/c")).expect("dirs");
    std::fs::write(tree.join("a/b/c/deep.txt"), "deep").expect("write");
    std::fs::write(tree.join("a/one.txt"), "one").expect("write");
    std::fs::write(tree.join("top.txt"), "top!").expect("write");
    std::fs::set_permissions(tree.join("top.txt"), std::fs::Permissions::from_mode(0o640))
        .expect("chmod");
    std::os::unix::fs::symlink("/etc", tree.join("etc-link")).expect("symlink");

    let paths = |listing: &oci::FileListing| -> Vec<String> {
        listing.entries.iter().map(|e| e.path.clone()).collect()
    };
    let one = sandbox.agent_list("tree", 1).await.expect("listing");
    assert_eq!(
        paths(&one),
        [
            "/workspace/tree/a",
            "/workspace/tree/etc-link",
            "/workspace/tree/top.txt"
        ]
    );
    assert!(!one.truncated);
    let link = &one.entries[1];
    assert_eq!(
        (link.kind, link.link_target.as_deref()),
        (FileKind::Symlink, Some("/etc"))
    );
    let top = &one.entries[2];
    assert_eq!((top.kind, top.size, top.mode), (FileKind::File, 4, 0o640));
    assert_eq!(one.entries[0].kind, FileKind::Directory);

    let two = sandbox
        .agent_list("/workspace/tree", 2)
        .await
        .expect("listing");
    assert_eq!(paths(&two).len(), 5, "{:?}", paths(&two));
    let all = sandbox.agent_list("tree", 16).await.expect("listing");
    assert_eq!(
        paths(&all),
        [
            "/workspace/tree/a",
            "/workspace/tree/a/b",
            "/workspace/tree/a/b/c",
            "/workspace/tree/a/b/c/deep.txt",
            "/workspace/tree/a/one.txt",
            "/workspace/tree/etc-link",
            "/workspace/tree/top.txt",
        ],
        "nothing under the symlink: it is never followed"
    );
    // A file, or a symlink, is its own one entry.
    let file = sandbox.agent_list("tree/a/one.txt", 1).await.expect("file");
    assert_eq!(
        (file.entries.len(), file.entries[0].kind),
        (1, FileKind::File)
    );
    let link = sandbox.agent_list("tree/etc-link", 3).await.expect("link");
    assert_eq!(
        (link.entries.len(), link.entries[0].kind),
        (1, FileKind::Symlink)
    );
    // Depth 0 is the path's own entry, a directory's too (a stat).
    let own = sandbox.agent_list("tree", 0).await.expect("stat");
    assert_eq!(
        (own.entries.len(), own.entries[0].kind),
        (1, FileKind::Directory)
    );
    assert!(
        own.entries[0].path.ends_with("/tree"),
        "{:?}",
        own.entries[0]
    );
    assert_eq!(code(sandbox.agent_list("tree", 17).await), "bad_request");
    assert_eq!(code(sandbox.agent_list("nowhere", 1).await), "not_found");

    // Past 10,000 entries: the first 10,000 and `truncated`.
    let many = t.workspace.join("many");
    std::fs::create_dir(&many).expect("dir");
    for i in 0..10_005 {
        std::fs::write(many.join(format!("f{i:05}")), "").expect("write");
    }
    let listing = sandbox.agent_list("many", 1).await.expect("listing");
    assert_eq!(
        (listing.entries.len(), listing.truncated),
        (oci::agent::files::LIST_ENTRIES_MAX, true)
    );
}

#[tokio::test]
async fn remove_move_and_mkdir_do_what_is_asked_and_refuse_the_rest() {
    let t = TestSandbox::start("files-ops", Limits::default()).await;
    let sandbox = &t.sandbox;
    let ws = &t.workspace;

    // mkdir: the mode asked (never setuid/setgid/sticky), parents on demand.
    assert!(
        sandbox
            .agent_mkdir("made", false, Some(0o750))
            .await
            .expect("mkdir")
    );
    assert_eq!(mode_of(&ws.join("made")), 0o750);
    assert_eq!(
        code(sandbox.agent_mkdir("made", false, None).await),
        "already_exists"
    );
    assert!(!sandbox.agent_mkdir("made", true, None).await.expect("-p"));
    assert_eq!(
        code(sandbox.agent_mkdir("x/y/z", false, None).await),
        "not_found"
    );
    assert!(
        sandbox
            .agent_mkdir("x/y/z", true, Some(0o3777))
            .await
            .expect("-p")
    );
    assert_eq!(mode_of(&ws.join("x/y/z")), 0o777);
    assert_eq!(mode_of(&ws.join("x/y")), 0o755);

    // move: one rename, an existing target only when asked.
    sandbox
        .agent_move("made", "moved", false)
        .await
        .expect("move");
    assert!(ws.join("moved").is_dir() && !ws.join("made").exists());
    write_file(sandbox, "a.txt", b"a", None, false)
        .await
        .expect("a");
    write_file(sandbox, "b.txt", b"b", None, false)
        .await
        .expect("b");
    assert_eq!(
        code(sandbox.agent_move("a.txt", "b.txt", false).await),
        "already_exists"
    );
    assert_eq!(std::fs::read(ws.join("b.txt")).expect("b"), b"b");
    sandbox
        .agent_move("a.txt", "b.txt", true)
        .await
        .expect("overwrite");
    assert_eq!(std::fs::read(ws.join("b.txt")).expect("b"), b"a");
    assert!(!ws.join("a.txt").exists());
    assert_eq!(
        code(sandbox.agent_move("a.txt", "c.txt", false).await),
        "not_found"
    );
    // /workspace is the caller's directory, /tmp the sandbox's tmpfs.
    assert_eq!(
        code(sandbox.agent_move("b.txt", "/tmp/b.txt", true).await),
        "cross_device"
    );
    assert_eq!(
        code(sandbox.agent_move("/workspace", "/elsewhere", false).await),
        "bad_request"
    );

    // remove: a non-empty directory only when recursive.
    assert_eq!(
        code(sandbox.agent_remove("x", false).await),
        "directory_not_empty"
    );
    sandbox.agent_remove("x", true).await.expect("rm -r");
    assert!(!ws.join("x").exists());
    assert_eq!(code(sandbox.agent_remove("x", true).await), "not_found");
    sandbox.agent_remove("moved", false).await.expect("rmdir");
    // A symlink goes, never what it points at.
    std::fs::create_dir(ws.join("kept")).expect("dir");
    std::fs::write(ws.join("kept/file"), "kept").expect("write");
    std::os::unix::fs::symlink("/workspace/kept", ws.join("link")).expect("symlink");
    sandbox.agent_remove("link", true).await.expect("rm link");
    assert!(std::fs::symlink_metadata(ws.join("link")).is_err());
    assert_eq!(std::fs::read(ws.join("kept/file")).expect("kept"), b"kept");
    // The root and the workspace, however named, stay.
    std::os::unix::fs::symlink("/", ws.join("rootlink")).expect("symlink");
    for protected in ["/", "/workspace", ".", "/workspace/", "rootlink/workspace"] {
        assert_eq!(
            code(sandbox.agent_remove(protected, true).await),
            "bad_request",
            "{protected}"
        );
    }
    assert_eq!(std::fs::read(ws.join("b.txt")).expect("still there"), b"a");
    assert_eq!(t.sh_ok("ls /usr/bin/env").await, "/usr/bin/env\n");
}

#[tokio::test]
async fn a_symlink_in_the_sandbox_never_makes_a_write_land_on_the_host() {
    let t = TestSandbox::start("files-links", Limits::default()).await;
    let sandbox = &t.sandbox;
    let host_dir = tempfile::Builder::new()
        .prefix("roost-host-")
        .tempdir()
        .expect("host dir");
    let host_file = host_dir.path().join("target");
    std::fs::write(&host_file, "host original").expect("host file");
    let passwd = std::fs::read("/etc/passwd").expect("host /etc/passwd");
    let host_dir_text = host_dir.path().to_str().expect("utf-8");
    t.sh_ok(&format!(
        "ln -s /etc /workspace/etc-link && ln -s /workspace/../../etc /workspace/dotdot-link \
         && ln -s {host_dir_text} /workspace/host-link"
    ))
    .await;

    // Into /etc through a symlink: the sandbox's /etc, read-only. Refused.
    assert_eq!(
        code(write_file(sandbox, "etc-link/passwd", b"owned\n", None, false).await),
        "permission_denied"
    );
    assert_eq!(
        code(write_file(sandbox, "dotdot-link/roost-probe", b"x", None, true).await),
        "permission_denied"
    );
    assert_eq!(
        code(sandbox.agent_mkdir("etc-link/roost-dir", false, None).await),
        "permission_denied"
    );
    assert_eq!(
        code(sandbox.agent_remove("etc-link/passwd", false).await),
        "permission_denied"
    );
    let tar = {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(6);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, "roost-tar-probe", &b"owned\n"[..])
            .expect("tar");
        builder.into_inner().expect("tar")
    };
    assert_eq!(
        code(tar_write(sandbox, "etc-link", &tar).await),
        "permission_denied"
    );
    assert!(std::fs::read("/etc/passwd").expect("host /etc/passwd") == passwd);
    assert!(!Path::new("/etc/roost-probe").exists());
    assert!(!Path::new("/etc/roost-dir").exists());
    assert!(!Path::new("/etc/roost-tar-probe").exists());

    // A host path means nothing in the sandbox: its own tree, or nothing.
    assert_eq!(
        code(write_file(sandbox, "host-link/target", b"sandbox", None, false).await),
        "not_found"
    );
    assert_eq!(
        code(
            write_file(
                sandbox,
                &format!("{host_dir_text}/target"),
                b"sandbox",
                None,
                false
            )
            .await
        ),
        "not_found"
    );
    t.sh_ok(&format!("mkdir -p {host_dir_text}")).await;
    write_file(sandbox, "host-link/target", b"sandbox", None, false)
        .await
        .expect("into the sandbox's own /tmp");
    assert_eq!(
        t.sh_ok(&format!("cat {host_dir_text}/target")).await,
        "sandbox"
    );
    assert_eq!(
        read_file(sandbox, "host-link/target").await.expect("read"),
        b"sandbox"
    );
    assert_eq!(
        std::fs::read(&host_file).expect("host file"),
        b"host original",
        "the host's file is untouched"
    );
}

/// A tree of `files` small files in 20 directories, an empty directory and
/// a symlink, on the host.
fn small_tree(root: &Path, files: usize) -> u64 {
    let mut bytes = 0;
    for i in 0..files {
        let dir = root.join(format!("d{:02}", i % 20));
        std::fs::create_dir_all(&dir).expect("dir");
        let content = format!("file {i}\n").repeat(i % 7 + 1);
        let path = dir.join(format!("f{i:05}.txt"));
        std::fs::write(&path, &content).expect("write");
        let mode = if i % 3 == 0 { 0o755 } else { 0o600 };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        bytes += content.len() as u64;
    }
    std::fs::create_dir(root.join("empty")).expect("dir");
    std::os::unix::fs::symlink("d00/f00000.txt", root.join("link")).expect("symlink");
    bytes
}

/// Every entry under `root` (relative path, and what it is: content and
/// mode, a directory's mode, a symlink's target), sorted.
fn tree_of(root: &Path) -> Vec<(PathBuf, String)> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir") {
            let path = entry.expect("entry").path();
            let metadata = std::fs::symlink_metadata(&path).expect("stat");
            let relative = path.strip_prefix(root).expect("under").to_path_buf();
            let what = if metadata.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(&path).expect("link").display())
            } else if metadata.is_dir() {
                pending.push(path.clone());
                format!("dir {:o}", metadata.mode() & 0o7777)
            } else {
                let content = std::fs::read(&path).expect("read");
                format!(
                    "file {:o} {}",
                    metadata.mode() & 0o7777,
                    String::from_utf8_lossy(&content)
                )
            };
            found.push((relative, what));
        }
    }
    found.sort();
    found
}

#[tokio::test]
async fn a_tree_of_2000_small_files_round_trips_through_tar_streams() {
    let t = TestSandbox::start("files-tar", Limits::default()).await;
    let sandbox = &t.sandbox;
    let bytes = small_tree(&t.workspace.join("src"), 2000);

    let started = Instant::now();
    let mut download = sandbox.agent_tar_read("src").await.expect("tar read");
    let mut tar = Vec::new();
    while let Some(chunk) = download.next_chunk().await.expect("chunk") {
        tar.extend_from_slice(&chunk);
    }
    let packed = started.elapsed();
    let summary = download.tar_summary().expect("a summary");
    assert_eq!(
        (
            summary.files,
            summary.directories,
            summary.symlinks,
            summary.bytes,
            summary.skipped
        ),
        (2000, 21, 1, bytes, 0)
    );
    // A plain tar stream: relative entries only.
    let mut archive = tar::Archive::new(tar.as_slice());
    let mut entries = 0;
    for entry in archive.entries().expect("entries") {
        let entry = entry.expect("entry");
        let path = entry.path().expect("path").into_owned();
        assert!(
            path.is_relative() && !path.components().any(|c| c.as_os_str() == ".."),
            "{}",
            path.display()
        );
        entries += 1;
    }
    assert_eq!(entries, 2000 + 21 + 1);

    // Trailing zeros past the archive's end (GNU tar pads its records) are
    // taken and dropped.
    let mut padded = tar.clone();
    padded.resize(tar.len() + 1024 * 1024, 0);
    let started = Instant::now();
    let unpacked = tar_write(sandbox, "/workspace/copy/nested", &padded)
        .await
        .expect("tar write");
    let unpacking = started.elapsed();
    assert_eq!(unpacked, summary);
    assert_eq!(
        tree_of(&t.workspace.join("src")),
        tree_of(&t.workspace.join("copy/nested")),
        "content, modes and the symlink as they were"
    );
    eprintln!("2,000 files: tar read {packed:?}, tar write {unpacking:?}");

    // A tar of a file, or of a symlink to a directory, is refused.
    assert_eq!(
        code(sandbox.agent_tar_read("src/link").await),
        "not_a_directory"
    );
    assert_eq!(
        code(sandbox.agent_tar_read("src/d00/f00000.txt").await),
        "not_a_directory"
    );
    assert_eq!(code(sandbox.agent_tar_read("nowhere").await), "not_found");
}

/// One raw tar entry: any name (no library checks), type, mode, data.
fn raw_entry(name: &[u8], entry_type: u8, mode: u32, data: &[u8], link: &[u8]) -> Vec<u8> {
    let mut header = tar::Header::new_old();
    header.as_old_mut().name[..name.len()].copy_from_slice(name);
    header.as_old_mut().linkname[..link.len()].copy_from_slice(link);
    header.set_mode(mode);
    header.set_size(data.len() as u64);
    header.set_mtime(1_700_000_000);
    header.set_entry_type(tar::EntryType::new(entry_type));
    header.set_cksum();
    let mut bytes = header.as_bytes().to_vec();
    bytes.extend_from_slice(data);
    bytes.resize(bytes.len().div_ceil(512) * 512, 0);
    bytes
}

fn archive(entries: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes: Vec<u8> = entries.concat();
    bytes.extend_from_slice(&[0u8; 1024]);
    bytes
}

#[tokio::test]
async fn a_hostile_tar_is_refused_or_neutralised_and_nothing_lands_outside() {
    let t = TestSandbox::start("files-hostile-tar", Limits::default()).await;
    let sandbox = &t.sandbox;
    let ws = &t.workspace;
    let passwd = std::fs::read("/etc/passwd").expect("host /etc/passwd");

    // Neutralised: setuid and setgid cleared, a fifo and a device skipped.
    let tar = archive(&[
        raw_entry(b"suid", b'0', 0o4755, b"#!/bin/sh\n", b""),
        raw_entry(b"fifo", b'6', 0o644, b"", b""),
        raw_entry(b"null", b'3', 0o666, b"", b""),
        raw_entry(b"shared/", b'5', 0o3777, b"", b""),
        raw_entry(b"shared/after.txt", b'0', 0o2644, b"after", b""),
    ]);
    let summary = tar_write(sandbox, "neutral", &tar).await.expect("unpacked");
    assert_eq!(
        (summary.files, summary.directories, summary.skipped),
        (2, 1, 2)
    );
    assert_eq!(mode_of(&ws.join("neutral/suid")), 0o755);
    assert_eq!(mode_of(&ws.join("neutral/shared")), 0o777);
    assert_eq!(mode_of(&ws.join("neutral/shared/after.txt")), 0o644);
    assert!(std::fs::symlink_metadata(ws.join("neutral/fifo")).is_err());
    assert!(std::fs::symlink_metadata(ws.join("neutral/null")).is_err());

    // Refused: what came before stays, nothing after, nothing outside.
    let refusals: [(&str, Vec<Vec<u8>>); 6] = [
        (
            "dotdot",
            vec![
                raw_entry(b"ok.txt", b'0', 0o644, b"ok", b""),
                raw_entry(b"../escape.txt", b'0', 0o644, b"escaped", b""),
                raw_entry(b"late.txt", b'0', 0o644, b"late", b""),
            ],
        ),
        (
            "absolute",
            vec![
                raw_entry(b"ok.txt", b'0', 0o644, b"ok", b""),
                raw_entry(b"/tmp/roost-abs.txt", b'0', 0o644, b"abs", b""),
            ],
        ),
        (
            "through-link",
            vec![
                raw_entry(b"ok.txt", b'0', 0o644, b"ok", b""),
                raw_entry(b"evil", b'2', 0o777, b"", b"/etc"),
                raw_entry(b"evil/roost-owned", b'0', 0o644, b"owned", b""),
            ],
        ),
        (
            "through-relative-link",
            vec![
                raw_entry(b"ok.txt", b'0', 0o644, b"ok", b""),
                raw_entry(b"up", b'2', 0o777, b"", b".."),
                raw_entry(b"up/escape.txt", b'0', 0o644, b"escaped", b""),
            ],
        ),
        (
            "hard-link-out",
            vec![
                raw_entry(b"ok.txt", b'0', 0o644, b"ok", b""),
                raw_entry(b"passwd", b'1', 0o644, b"", b"../../etc/passwd"),
            ],
        ),
        (
            "directory-over-link",
            vec![
                raw_entry(b"ok.txt", b'0', 0o644, b"ok", b""),
                raw_entry(b"etc2", b'2', 0o777, b"", b"/etc"),
                raw_entry(b"etc2/", b'5', 0o755, b"", b""),
            ],
        ),
    ];
    for (name, entries) in refusals {
        let refused = tar_write(sandbox, &format!("refused/{name}"), &archive(&entries)).await;
        assert_eq!(code(refused), "bad_request", "{name}");
        let dir = ws.join("refused").join(name);
        assert_eq!(
            std::fs::read(dir.join("ok.txt")).expect(name),
            b"ok",
            "{name}"
        );
        assert!(!dir.join("late.txt").exists(), "{name}");
    }
    assert!(!ws.join("refused/escape.txt").exists());
    assert!(!ws.join("escape.txt").exists());
    assert!(!Path::new("/tmp/roost-abs.txt").exists());
    assert!(!Path::new("/etc/roost-owned").exists());
    assert_eq!(
        t.sh_ok("ls /tmp/roost-abs.txt /etc/roost-owned 2>/dev/null; true")
            .await,
        ""
    );

    // A symlink already in the tree is never followed either.
    t.sh_ok("mkdir -p /workspace/pre && ln -s /etc /workspace/pre/etc")
        .await;
    let through = archive(&[raw_entry(b"etc/passwd", b'0', 0o644, b"owned\n", b"")]);
    assert_eq!(
        code(tar_write(sandbox, "pre", &through).await),
        "bad_request"
    );
    let over = archive(&[raw_entry(b"etc", b'0', 0o644, b"a file now\n", b"")]);
    tar_write(sandbox, "pre", &over)
        .await
        .expect("a file entry replaces the symlink itself");
    assert_eq!(
        std::fs::read(ws.join("pre/etc")).expect("file"),
        b"a file now\n"
    );
    assert!(std::fs::read("/etc/passwd").expect("host /etc/passwd") == passwd);

    // Broken streams: a bad header, data cut short. What came before stays,
    // never a partly written file.
    let mut bad_header = raw_entry(b"second.txt", b'0', 0o644, b"2", b"");
    bad_header[148] ^= 1;
    let broken = archive(&[raw_entry(b"first.txt", b'0', 0o644, b"1", b""), bad_header]);
    assert_eq!(
        code(tar_write(sandbox, "broken", &broken).await),
        "bad_request"
    );
    assert_eq!(
        std::fs::read(ws.join("broken/first.txt")).expect("first"),
        b"1"
    );
    let mut cut = raw_entry(b"cut.bin", b'0', 0o644, &[7u8; 10_000], b"");
    cut.truncate(512 + 100);
    assert_eq!(code(tar_write(sandbox, "cut", &cut).await), "bad_request");
    assert!(std::fs::symlink_metadata(ws.join("cut/cut.bin")).is_err());

    assert_eq!(t.sh_ok("echo still serving").await, "still serving\n");
}

/// A small tmpfs mounted over a sandbox's workspace on the host, unmounted
/// (and the test's directory removed) once the sandbox is gone.
struct SmallDisk {
    workspace: PathBuf,
    temp_root: PathBuf,
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.workspace, rustix::mount::UnmountFlags::DETACH);
        let _ = std::fs::remove_dir_all(&self.temp_root);
    }
}

#[tokio::test]
async fn a_full_disk_ends_a_write_insufficient_storage_with_nothing_half_written() {
    let (dir, config) = prepare("files-full", Limits::default());
    rustix::mount::mount(
        "tmpfs",
        &config.workspace,
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        c"size=2m,mode=0755",
    )
    .expect("a small tmpfs on the workspace");
    let _disk = SmallDisk {
        workspace: config.workspace.clone(),
        temp_root: dir.path().to_path_buf(),
    };
    std::fs::write(config.workspace.join("keep.txt"), "old").expect("host write");
    let t = TestSandbox::start_config(dir, config).await;
    let sandbox = &t.sandbox;
    let ws = &t.workspace;
    let big = pseudo_random(4 * 1024 * 1024, 4);

    // Over an existing file: it keeps its old content.
    assert_eq!(
        code(write_file(sandbox, "keep.txt", &big, None, false).await),
        "insufficient_storage"
    );
    assert_eq!(std::fs::read(ws.join("keep.txt")).expect("kept"), b"old");
    // A new file: nothing under its name.
    assert_eq!(
        code(write_file(sandbox, "sub/new.bin", &big, None, true).await),
        "insufficient_storage"
    );
    assert!(std::fs::symlink_metadata(ws.join("sub/new.bin")).is_err());
    assert!(leftovers(ws).is_empty() && leftovers(&ws.join("sub")).is_empty());
    // Through a tar: the entry that did not fit is not left partly written.
    let tar = {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(big.len() as u64);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, "big.bin", big.as_slice())
            .expect("tar");
        builder.into_inner().expect("tar")
    };
    assert_eq!(
        code(tar_write(sandbox, "unpacked", &tar).await),
        "insufficient_storage"
    );
    assert!(std::fs::symlink_metadata(ws.join("unpacked/big.bin")).is_err());

    // The space is free again: a small write goes through.
    write_file(sandbox, "small.txt", b"fits", None, false)
        .await
        .expect("fits");
    assert_eq!(std::fs::read(ws.join("small.txt")).expect("small"), b"fits");

    // An upload abandoned midway (the runner went away) leaves nothing.
    let mut writer = sandbox
        .agent_write_file("abandoned.bin", None, false)
        .await
        .expect("upload");
    writer.write(&big[..256 * 1024]).await.expect("a part");
    drop(writer);
    let workspace = ws.clone();
    assert!(
        eventually(Duration::from_secs(10), || leftovers(&workspace).is_empty()).await,
        "the temporary file stays: {:?}",
        leftovers(ws)
    );
    assert!(std::fs::symlink_metadata(ws.join("abandoned.bin")).is_err());
    assert_eq!(t.sh_ok("echo fine").await, "fine\n");
}

/// Audit finding: an upload cut by the agent's own death (its sandbox
/// stopped or killed mid-upload) left its `.roost-upload-` temporary in
/// the directory, saved with the home. The file has no name until it is
/// whole now, so a dead agent leaves nothing.
#[tokio::test]
async fn an_upload_cut_by_the_agents_death_leaves_nothing() {
    let t = TestSandbox::start("files-killed", Limits::default()).await;
    let sandbox = &t.sandbox;
    let mut writer = sandbox
        .agent_write_file("cut.bin", None, false)
        .await
        .expect("upload");
    writer
        .write(&pseudo_random(4 * 1024 * 1024, 9))
        .await
        .expect("a part");
    // Under way, nothing in the directory has a name of the upload's.
    assert!(
        leftovers(&t.workspace).is_empty(),
        "{:?}",
        leftovers(&t.workspace)
    );
    let init_pid = init_pid(sandbox).await;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(init_pid).expect("a pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the init");
    drop(writer);
    assert!(
        eventually(Duration::from_secs(20), || !process_alive(init_pid)).await,
        "the init outlived SIGKILL"
    );
    assert!(
        leftovers(&t.workspace).is_empty(),
        "{:?}",
        leftovers(&t.workspace)
    );
    assert!(std::fs::symlink_metadata(t.workspace.join("cut.bin")).is_err());
}

/// A raw frame: its kind and payload.
type RawFrame = (u8, Vec<u8>);

/// Sends `first` and then `rest` on a raw connection to the agent; its
/// answer frames until it closes.
async fn raw_request(sandbox: &Sandbox, first: RawFrame, rest: &[RawFrame]) -> Vec<wire::Frame> {
    let path = sandbox.paths().bundle().join(oci::agent::SOCKET_NAME);
    let stream = tokio::net::UnixStream::connect(&path)
        .await
        .expect("connect");
    let (mut reader, mut writer) = stream.into_split();
    wire::write_frame(&mut writer, first.0, &first.1)
        .await
        .expect("send");
    for (frame_kind, payload) in rest {
        // The agent may have refused and gone already.
        if wire::write_frame(&mut writer, *frame_kind, payload)
            .await
            .is_err()
        {
            break;
        }
    }
    let mut frames = Vec::new();
    while let Ok(Ok(Some(frame))) =
        tokio::time::timeout(Duration::from_secs(30), wire::read_frame(&mut reader)).await
    {
        frames.push(frame);
    }
    frames
}

fn error_code(frames: &[wire::Frame]) -> Option<String> {
    let last = frames.last()?;
    (last.kind == kind::ERROR).then(|| {
        last.json().expect("json")["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    })
}

#[tokio::test]
async fn bad_paths_and_requests_get_bad_request_and_the_agent_keeps_serving() {
    let t = TestSandbox::start("files-bad", Limits::default()).await;
    let sandbox = &t.sandbox;
    std::fs::write(t.workspace.join("file.txt"), "file").expect("host write");
    let passwd = std::fs::read("/etc/passwd").expect("host /etc/passwd");
    let long = "x/".repeat(2049);
    let bad_paths = [
        "",
        "a\0b",
        "../etc/passwd",
        "/workspace/../etc/passwd",
        "a/../../etc/passwd",
        "..",
        long.as_str(),
    ];
    for bad in bad_paths {
        let shown = &bad[..bad.len().min(30)];
        assert_eq!(
            code(sandbox.agent_read_file(bad, 0, None).await),
            "bad_request",
            "{shown}"
        );
        assert_eq!(
            code(write_file(sandbox, bad, b"owned\n", None, true).await),
            "bad_request",
            "{shown}"
        );
        assert_eq!(
            code(sandbox.agent_list(bad, 1).await),
            "bad_request",
            "{shown}"
        );
        assert_eq!(
            code(sandbox.agent_remove(bad, true).await),
            "bad_request",
            "{shown}"
        );
        assert_eq!(
            code(sandbox.agent_move("file.txt", bad, true).await),
            "bad_request",
            "{shown}"
        );
        assert_eq!(
            code(sandbox.agent_move(bad, "moved.txt", true).await),
            "bad_request",
            "{shown}"
        );
        assert_eq!(
            code(sandbox.agent_mkdir(bad, true, None).await),
            "bad_request",
            "{shown}"
        );
        assert_eq!(
            code(sandbox.agent_tar_read(bad).await),
            "bad_request",
            "{shown}"
        );
        assert_eq!(
            code(tar_write(sandbox, bad, &archive(&[])).await),
            "bad_request",
            "{shown}"
        );
    }
    assert_eq!(
        std::fs::read(t.workspace.join("file.txt")).expect("file"),
        b"file"
    );
    assert!(std::fs::read("/etc/passwd").expect("host /etc/passwd") == passwd);

    // Malformed requests and a stray frame mid-upload: a code, no leftover.
    let json = |value: serde_json::Value| value.to_string().into_bytes();
    let cases: [(RawFrame, Vec<RawFrame>); 5] = [
        ((kind::FILE_READ, b"not json".to_vec()), vec![]),
        (
            (
                kind::FILE_WRITE,
                json(serde_json::json!({"path": "m.txt", "mode": "rwx"})),
            ),
            vec![],
        ),
        (
            (
                kind::FILE_READ,
                json(serde_json::json!({"path": "file.txt", "length": -1})),
            ),
            vec![],
        ),
        (
            (kind::FILE_LIST, json(serde_json::json!({"path": 7}))),
            vec![],
        ),
        (
            (
                kind::FILE_WRITE,
                json(serde_json::json!({"path": "stray.txt"})),
            ),
            vec![
                (kind::DATA, b"part".to_vec()),
                (kind::STDIN_DATA, b"x".to_vec()),
            ],
        ),
    ];
    for (first, rest) in cases {
        let frames = raw_request(sandbox, first, &rest).await;
        assert_eq!(error_code(&frames).as_deref(), Some("bad_request"));
    }
    assert!(std::fs::symlink_metadata(t.workspace.join("stray.txt")).is_err());
    assert!(std::fs::symlink_metadata(t.workspace.join("m.txt")).is_err());
    let workspace = t.workspace.clone();
    assert!(eventually(Duration::from_secs(10), || leftovers(&workspace).is_empty()).await);

    // Still serving commands and files.
    assert_eq!(t.sh_ok("echo fine").await, "fine\n");
    assert_eq!(read_file(sandbox, "file.txt").await.expect("read"), b"file");
}
