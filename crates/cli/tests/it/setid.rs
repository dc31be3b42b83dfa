//! Issue 14, "no setuid program reaches the host", as the attack was run:
//! an org imports an image holding a mode-4755 copy of `id`, and a sandbox
//! runs `chmod 4755` on a copy of `id` in `/workspace`. Neither may give an
//! unprivileged host user euid 0: the store holds neither bit, the runner's
//! data dir is root's alone, its home volume is mounted `nosuid,nodev`, and
//! a home saved and woken on another runner comes back without the bit.
//! Needs root, runc and busybox-static, like the other end-to-end tests.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;

use crate::harness::BIN;
use crate::plane::{Api, Plane};
use crate::runner_e2e::{RunnerProcess, create_running, sh, wait_sandbox};

/// Where the host's `id` is: what the attack copies.
const ID: &str = "/usr/bin/id";
/// The unprivileged host user who tries the planted programs.
const NOBODY: &str = "65534";

fn mode_of(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Runs `program -u` as uid/gid 65534 with no groups: what `id -u` prints
/// is the euid it got, if it could run at all.
fn euid_as_nobody(program: &Path) -> Option<String> {
    let output = Command::new("setpriv")
        .args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
        ])
        .arg(program)
        .arg("-u")
        .output()
        .expect("setpriv (util-linux)");
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The per-mount options `/proc/self/mountinfo` shows for the last mount at
/// `path` (canonical; the test's paths have nothing mountinfo escapes).
fn mount_options(path: &Path) -> Option<Vec<String>> {
    let path = std::fs::canonicalize(path).expect("canonical path");
    let path = path.to_str().expect("utf-8 path");
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .rfind(|line| line.split(' ').nth(4) == Some(path))
        .and_then(|line| line.split(' ').nth(5))
        .map(|options| options.split(',').map(str::to_owned).collect())
}

/// What an unprivileged host user can make of a runner: nothing under its
/// data dir, and nothing setuid-effective on its home volume.
fn assert_host_safe(data_dir: &Path) {
    assert_eq!(
        mode_of(data_dir),
        0o700,
        "the runner's data dir {} is not root's alone",
        data_dir.display()
    );
    let options = mount_options(&data_dir.join("volumes")).expect("the home volume is a mount");
    for wanted in ["nosuid", "nodev"] {
        assert!(
            options.iter().any(|o| o == wanted),
            "the home volume is mounted without {wanted}: {options:?}"
        );
    }
}

fn store_tree(store: &store::Store, org: &store::OrgId, root: &str) -> store::tree::Tree {
    let digest: store::Digest = root.parse().expect("digest");
    store.get_tree(org, &digest).expect("tree in the store")
}

fn entry_mode(tree: &store::tree::Tree, name: &str) -> u32 {
    tree.entries
        .iter()
        .find(|e| e.name == name.as_bytes())
        .unwrap_or_else(|| panic!("no {name:?} in the tree"))
        .mode
}

fn subtree(
    store: &store::Store,
    org: &store::OrgId,
    tree: &store::tree::Tree,
    name: &str,
) -> store::tree::Tree {
    match &tree
        .entries
        .iter()
        .find(|e| e.name == name.as_bytes())
        .expect("entry")
        .kind
    {
        store::tree::EntryKind::Dir { tree } => store.get_tree(org, tree).expect("subtree"),
        other => panic!("{name} is not a directory: {other:?}"),
    }
}

/// `roost image import NAME DIR` of a static busybox root with a mode-4755
/// copy of `id` as /bin/id; the import's JSON answer.
fn import_setuid_image(api: &Api, work: &Path) -> serde_json::Value {
    let tree = work.join("image");
    let bin = tree.join("bin");
    std::fs::create_dir_all(&bin).expect("bin");
    std::fs::copy("/bin/busybox", bin.join("busybox"))
        .expect("/bin/busybox (apt-get install busybox-static)");
    std::os::unix::fs::symlink("busybox", bin.join("sh")).expect("sh");
    std::fs::copy(ID, bin.join("id")).expect("copy id");
    std::fs::set_permissions(bin.join("id"), std::fs::Permissions::from_mode(0o4755))
        .expect("chmod 4755");
    let output = Command::new(BIN)
        .args(["image", "import", "planted"])
        .arg(&tree)
        .args(["--json", "--url", &api.url, "--token", &api.token])
        .output()
        .expect("roost image import");
    assert!(
        output.status.success(),
        "import failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("import prints one JSON document")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_setuid_program_reaches_the_host() {
    let store_dir = tempfile::tempdir().expect("store dir");
    let store_arg = store_dir.path().to_str().expect("utf-8").to_owned();
    let plane = Plane::start(&["--store", &store_arg]).await;
    let dir = tempfile::Builder::new()
        .prefix("roost-setid-")
        .tempdir()
        .expect("tempdir");
    // Open as the directories above a real data dir (/var/lib) are: only
    // the runner's own modes may keep a host user out.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod the test dir");
    let data_a: PathBuf = dir.path().join("a");
    let runner_a = RunnerProcess::start(&plane.server.url, &plane.runner_token, &data_a, &[]);
    let api = &plane.org;
    let store = store::Store::open(&store_arg).expect("store");
    let org: store::OrgId = plane.org_id.parse().expect("org id");

    // Through the API: the image is stored without the bit, and the tree
    // the runner materialises from it has none.
    let imported = import_setuid_image(api, dir.path());
    let root = imported["image"]["root"].as_str().expect("image root");
    let bin = subtree(&store, &org, &store_tree(&store, &org, root), "bin");
    assert_eq!(
        entry_mode(&bin, "id"),
        0o755,
        "the image stored a setuid bit"
    );
    let image_sandbox = create_running(api, json!({"image": "planted"})).await;
    let images: Vec<PathBuf> = std::fs::read_dir(data_a.join("images"))
        .expect("the runner's images")
        .flatten()
        .map(|entry| entry.path().join("bin/id"))
        .filter(|path| path.exists())
        .collect();
    assert_eq!(images.len(), 1, "one materialised image: {images:?}");
    assert_eq!(mode_of(&images[0]), 0o755, "{}", images[0].display());
    assert_ne!(
        euid_as_nobody(&images[0]).as_deref(),
        Some("0"),
        "an unprivileged host user ran the image's id as root"
    );

    // Through a sandbox: root in it makes a setuid-root copy of `id` in
    // its home, which is on the runner's home volume.
    let id = create_running(api, json!({"storage_class": "durable"})).await;
    let made = sh(
        api,
        &id,
        &format!("cp {ID} /workspace/id && chmod 4755 /workspace/id && stat -c %a /workspace/id"),
    )
    .await;
    assert_eq!(made.trim(), "4755", "the sandbox could not even plant it");
    let planted = data_a.join("volumes/homes").join(&id).join("id");
    assert_eq!(
        mode_of(&planted),
        0o4755,
        "the attack is real: the host sees the bit the sandbox set"
    );
    assert_host_safe(&data_a);
    assert_ne!(
        euid_as_nobody(&planted).as_deref(),
        Some("0"),
        "an unprivileged host user ran the sandbox's setuid copy of id as root"
    );

    // Saved (stop secures the home) without the bit, and woken on another
    // runner without it.
    let stop = api
        .post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    assert_eq!(stop.status, 202, "{stop:?}");
    let stopped = wait_sandbox(api, &id, "stopped").await;
    assert_eq!(stopped["save"]["state"], "ok", "{stopped}");
    let saved = stopped["save"]["root"].as_str().expect("save root");
    assert_eq!(
        entry_mode(&store_tree(&store, &org, saved), "id"),
        0o755,
        "the save stored a setuid bit"
    );
    let data_b = dir.path().join("b");
    let runner_b = RunnerProcess::start(&plane.server.url, &plane.runner_token, &data_b, &[]);
    let drained = plane
        .admin
        .post(
            &format!("/v1/admin/runners/{}/drain", runner_a.runner_id),
            json!({}),
        )
        .await;
    assert_eq!(drained.status, 200, "{drained:?}");
    let start = api
        .post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    assert_eq!(start.status, 202, "{start:?}");
    let running = wait_sandbox(api, &id, "running").await;
    assert_eq!(
        running["runner_id"],
        runner_b.runner_id.as_str(),
        "{running}"
    );
    assert_eq!(sh(api, &id, "stat -c %a /workspace/id").await.trim(), "755");
    let restored = data_b.join("volumes/homes").join(&id).join("id");
    assert_eq!(mode_of(&restored), 0o755, "the wake restored a setuid bit");
    assert_host_safe(&data_b);
    let _ = wait_sandbox(api, &image_sandbox, "running").await;
    runner_b.assert_no_errors();
}
