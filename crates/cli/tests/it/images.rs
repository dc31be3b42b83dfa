//! Images end to end: `roost image import` through the block service into
//! the server's store, a real runner materialising the image (only what
//! it lacks) and running it; the block service's refusals.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use crate::harness::BIN;
use crate::plane::{Api, block_download_requests, block_downloads, metric, new_org};
use crate::runner_e2e::{Stack, sh, wait_sandbox};

/// A root filesystem of a static busybox (no libc) and `files` small
/// distinct files under /data, so that changes are easy to count.
fn busybox_tree(dir: &Path, files: usize) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("bin");
    std::fs::create_dir_all(dir.join("etc")).expect("etc");
    std::fs::create_dir_all(dir.join("data")).expect("data");
    std::fs::copy("/bin/busybox", bin.join("busybox"))
        .expect("/bin/busybox (apt-get install busybox-static)");
    for applet in ["sh", "cat", "ls", "echo", "wc"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).expect("applet link");
    }
    std::fs::write(dir.join("etc/os-release"), "ID=roost-busybox\n").expect("os-release");
    for i in 0..files {
        std::fs::write(dir.join(format!("data/f{i}")), format!("file {i}\n")).expect("data");
    }
}

/// `tar -C tree -cf archive .`, as a build tool would hand an image over.
fn tar_of(tree: &Path, archive: &Path) -> std::path::PathBuf {
    let status = Command::new("tar")
        .arg("-C")
        .arg(tree)
        .arg("-cf")
        .arg(archive)
        .arg(".")
        .status()
        .expect("tar");
    assert!(status.success());
    archive.to_path_buf()
}

fn import(api: &Api, name: &str, path: &Path) -> Value {
    let output = Command::new(BIN)
        .args(["image", "import", name])
        .arg(path)
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
async fn an_imported_image_runs_and_a_new_version_brings_only_its_changes() {
    let store = tempfile::tempdir().expect("store dir");
    let store_arg = store.path().to_str().expect("utf-8").to_owned();
    let stack = Stack::start_full(&["--store", &store_arg], &[]).await;
    let api = stack.api();
    let work = tempfile::tempdir().expect("work dir");

    // v1 as a tar archive (what `tar` or a build tool hands over).
    let tree = work.path().join("tree");
    busybox_tree(&tree, 60);
    let v1 = import(api, "busy", &tar_of(&tree, &work.path().join("v1.tar")));
    assert_eq!(v1["source"], "tar", "{v1}");
    assert_eq!(v1["image"]["name"], "busy");
    assert_eq!(v1["image"]["files"], 62, "{v1}");
    assert!(v1["blocks_uploaded"].as_u64() >= Some(62), "{v1}");

    let listed = api.get("/v1/images").await;
    assert_eq!(listed.body["images"][0]["root"], v1["image"]["root"]);

    let before = block_downloads(api).await;
    let requests_before = block_download_requests(api).await;
    let sandbox = stack.running_sandbox(json!({"image": "busy"})).await;
    let sid = sandbox["id"].as_str().expect("id");
    let first_pull = block_downloads(api).await - before;
    let first_requests = block_download_requests(api).await - requests_before;
    assert!(
        first_pull >= 62,
        "the first materialisation fetched {first_pull} objects"
    );
    // A directory's small files come down together: /data's 60 files in
    // one fetch, not one request each.
    assert!(
        first_requests <= 10,
        "{first_requests} download requests for {first_pull} objects"
    );
    assert_eq!(
        sh(api, sid, "cat /etc/os-release").await,
        "ID=roost-busybox\n"
    );
    assert_eq!(sh(api, sid, "ls /data | wc -l").await.trim(), "60");

    // v2 changes one file: one block goes up, and a sandbox of v2 on the
    // same runner brings down only that block and the trees above it.
    std::fs::write(tree.join("data/f7"), "changed\n").expect("change");
    let v2 = import(api, "busy", &tar_of(&tree, &work.path().join("v2.tar")));
    assert_eq!(v2["source"], "tar", "{v2}");
    assert_eq!(v2["blocks_uploaded"], 1, "{v2}");
    assert_ne!(v2["image"]["root"], v1["image"]["root"]);
    let before = block_downloads(api).await;
    let second = stack.running_sandbox(json!({"image": "busy"})).await;
    let second_id = second["id"].as_str().expect("id");
    let second_pull = block_downloads(api).await - before;
    assert!(
        (1..=3).contains(&second_pull),
        "v2 fetched {second_pull} objects; expected its one new block and the changed trees"
    );
    assert_eq!(sh(api, second_id, "cat /data/f7").await, "changed\n");
    // The first sandbox keeps the tree it was created with.
    assert_eq!(sh(api, sid, "cat /data/f7").await, "file 7\n");
    // What one sandbox writes into the image lands in its own layer only:
    // neither the other sandbox nor the runner's copy of the image sees it.
    sh(
        api,
        second_id,
        "echo mine > /data/f8; echo new > /bin/added",
    )
    .await;
    assert_eq!(sh(api, second_id, "cat /data/f8").await, "mine\n");
    let third_view = sh(api, sid, "cat /data/f8; ls /bin/added 2>&1 || true").await;
    assert!(third_view.starts_with("file 8\n"), "{third_view}");
    assert!(!third_view.contains("new"), "{third_view}");
    let images_dir = stack.runner.data_dir.join("images");
    for entry in std::fs::read_dir(&images_dir)
        .expect("images dir")
        .flatten()
    {
        let f8 = entry.path().join("data/f8");
        assert_eq!(
            std::fs::read_to_string(&f8).expect("image file"),
            "file 8\n"
        );
        assert!(!entry.path().join("bin/added").exists());
    }

    // `docker save` output (manifest.json naming layer tars) and a plain
    // directory import the same way.
    let docker = work.path().join("docker");
    std::fs::create_dir(&docker).expect("docker dir");
    tar_of(&tree, &docker.join("layer.tar"));
    std::fs::write(docker.join("config.json"), "{}").expect("config");
    std::fs::write(
        docker.join("manifest.json"),
        r#"[{"Config":"config.json","RepoTags":["busy:latest"],"Layers":["layer.tar"]}]"#,
    )
    .expect("manifest");
    let saved = import(
        api,
        "busy-docker",
        &tar_of(&docker, &work.path().join("saved.tar")),
    );
    assert_eq!(saved["source"], "docker_archive", "{saved}");
    assert_eq!(
        saved["image"]["root"], v2["image"]["root"],
        "same tree, same root"
    );
    assert_eq!(saved["blocks_uploaded"], 0, "{saved}");
    let from_dir = import(api, "busy-dir", &tree);
    assert_eq!(from_dir["source"], "directory", "{from_dir}");
    let third = stack.running_sandbox(json!({"image": "busy-docker"})).await;
    assert_eq!(
        sh(api, third["id"].as_str().expect("id"), "cat /data/f7").await,
        "changed\n"
    );

    // Audit finding: every launch of an image not yet on the runner
    // downloaded (and stored) its own copy. Three sandboxes of a new image
    // created at once share one materialisation.
    std::fs::write(tree.join("data/f9"), "once\n").expect("change");
    let v3 = import(api, "busy-3", &tar_of(&tree, &work.path().join("v3.tar")));
    let v3_root = v3["image"]["root"].as_str().expect("root").to_owned();
    let mut at_once = Vec::new();
    for _ in 0..3 {
        let created = api.post("/v1/sandboxes", json!({"image": "busy-3"})).await;
        assert_eq!(created.status, 201, "{created:?}");
        at_once.push(created.str("id"));
    }
    for id in &at_once {
        assert_eq!(wait_sandbox(api, id, "running").await["state"], "running");
        assert_eq!(sh(api, id, "cat /data/f9").await, "once\n");
    }
    assert_eq!(
        stack
            .runner
            .log_lines_with(&["image materialised", v3_root.as_str()]),
        1,
        "one materialisation for three launches"
    );

    // An unknown image is refused at admission, naming it.
    let refused = api.post("/v1/sandboxes", json!({"image": "nope"})).await;
    refused.assert_error(422, "unsupported_capability");
    assert_eq!(
        refused.body["error"]["details"]["missing"],
        json!(["image:nope"])
    );

    // Deleting the image refuses new sandboxes of it.
    assert_eq!(api.delete("/v1/images/busy").await.status, 200);
    api.post("/v1/sandboxes", json!({"image": "busy"}))
        .await
        .assert_error(422, "unsupported_capability");
    let _ = wait_sandbox(api, sid, "running").await;
}

/// Audit finding: a runner kept every image tree it ever materialised, so
/// an org importing image after image could fill its disk for every
/// org. Past `--image-cache-max`, trees no sandbox on the runner uses go,
/// least recently used first; one in use stays, and one removed comes
/// back when a sandbox asks for it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_keeps_its_image_trees_within_its_bound_and_never_one_in_use() {
    let store = tempfile::tempdir().expect("store dir");
    let store_arg = store.path().to_str().expect("utf-8").to_owned();
    let stack =
        Stack::start_with_args(&["--store", &store_arg], &["--image-cache-max", "1MiB"]).await;
    let api = stack.api();
    let work = tempfile::tempdir().expect("work dir");
    // Two images, each over the bound alone (busybox is ~1-2 MiB).
    let mut roots = Vec::new();
    for name in ["one", "two", "three"] {
        let tree = work.path().join(name);
        busybox_tree(&tree, 20);
        std::fs::write(tree.join("etc/name"), format!("{name}\n")).expect("name");
        let imported = import(
            api,
            name,
            &tar_of(&tree, &work.path().join(format!("{name}.tar"))),
        );
        roots.push(
            imported["image"]["root"]
                .as_str()
                .expect("a root")
                .to_owned(),
        );
    }
    let trees = stack.runner.data_dir.join("images");
    let (one, two) = (trees.join(&roots[0]), trees.join(&roots[1]));

    let first = stack.running_sandbox(json!({"image": "one"})).await;
    let first = first["id"].as_str().expect("id").to_owned();
    assert_eq!(sh(api, &first, "cat /etc/name").await, "one\n");
    assert!(one.is_dir());
    let deleted = api.delete(&format!("/v1/sandboxes/{first}")).await;
    assert_eq!(deleted.status, 202, "{deleted:?}");
    assert_eq!(
        wait_sandbox(api, &first, "deleted").await["state"],
        "deleted"
    );

    // A sandbox of the other image: past the bound, the unused tree goes;
    // the one in use stays, however far past the bound it is.
    let collections = || stack.runner.log_lines_with(&["image trees collected"]);
    let collected_before = collections();
    let second = stack.running_sandbox(json!({"image": "two"})).await;
    let second = second["id"].as_str().expect("id").to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while one.exists() || collections() == collected_before {
        assert!(
            std::time::Instant::now() < deadline,
            "the unused tree stays past the bound"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // The collection that took it is over: the tree in use stayed.
    assert!(two.join("etc/name").is_file(), "the tree in use went");
    assert_eq!(sh(api, &second, "cat /etc/name").await, "two\n");

    // Asked for again: materialised again, and it runs; the collection
    // after it takes neither tree, both in use.
    let collected_before = collections();
    let third = stack.running_sandbox(json!({"image": "one"})).await;
    let third = third["id"].as_str().expect("id").to_owned();
    assert_eq!(sh(api, &third, "cat /etc/name").await, "one\n");
    while collections() == collected_before {
        assert!(
            std::time::Instant::now() < deadline + std::time::Duration::from_secs(60),
            "no collection after a new tree"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(
        one.join("etc/name").is_file() && two.join("etc/name").is_file(),
        "a tree in use went"
    );
    // A stopped sandbox's tree is in use too: it starts again on it.
    let stop = api
        .post(&format!("/v1/sandboxes/{second}/stop"), json!({}))
        .await;
    assert_eq!(stop.status, 202, "{stop:?}");
    assert_eq!(
        wait_sandbox(api, &second, "stopped").await["state"],
        "stopped"
    );
    let collected_before = collections();
    let fourth = stack.running_sandbox(json!({"image": "three"})).await;
    let fourth = fourth["id"].as_str().expect("id").to_owned();
    while collections() == collected_before {
        assert!(
            std::time::Instant::now() < deadline + std::time::Duration::from_secs(120),
            "no collection after a new tree"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(
        two.join("etc/name").is_file(),
        "a stopped sandbox's tree went"
    );
    assert_eq!(sh(api, &fourth, "cat /etc/name").await, "three\n");
    stack.runner.assert_no_errors();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_service_verifies_uploads_and_keeps_orgs_apart() {
    let store = tempfile::tempdir().expect("store dir");
    let store_arg = store.path().to_str().expect("utf-8").to_owned();
    let plane = crate::plane::Plane::start(&["--store", &store_arg]).await;
    let org = &plane.org;
    let org_id = &plane.org_id;
    let content = b"hello blocks";
    let digest = store::Digest::of(content).to_hex();
    let path = format!("/v1/blocks/{org_id}/blocks/{digest}");
    let put = |api: &Api, path: String, body: Vec<u8>| {
        let api = Api::new(&api.url, &api.token);
        async move {
            api.send(reqwest::Method::PUT, &path, Some(body), &[])
                .await
                .expect("request")
        }
    };

    // A body that does not hash to its name is refused and not stored.
    let wrong = store::block::encode(b"something else");
    let refused = put(org, path.clone(), wrong).await;
    refused.assert_error(400, "invalid_request");
    let missing = org
        .post(
            &format!("/v1/blocks/{org_id}/missing"),
            json!({"objects": [format!("blocks/{digest}")]}),
        )
        .await;
    assert_eq!(missing.body["missing"], json!([format!("blocks/{digest}")]));

    // The right bytes are stored and read back.
    let stored = put(org, path.clone(), store::block::encode(content)).await;
    assert_eq!(stored.status, 204, "{stored:?}");
    let missing = org
        .post(
            &format!("/v1/blocks/{org_id}/missing"),
            json!({"objects": [format!("blocks/{digest}")]}),
        )
        .await;
    assert_eq!(missing.body["missing"], json!([]));
    let read = org.get(&path).await;
    assert_eq!(read.status, 200);
    assert_eq!(
        store::block::decode(&store::Digest::of(content), &read.bytes).expect("decodes"),
        content
    );

    // Another org's token finds nothing there; its own path has nothing.
    let (other, other_id) = new_org(&plane.admin, "other", json!({})).await;
    other.get(&path).await.assert_error(404, "not_found");
    other
        .get(&format!("/v1/blocks/{other_id}/blocks/{digest}"))
        .await
        .assert_error(404, "not_found");
    // A runner reaches an org's objects only while it runs a sandbox of
    // that org; the runner token (which only registers runners) never.
    Api::new(&plane.server.url, &plane.runner_token)
        .get(&path)
        .await
        .assert_error(404, "not_found");
    let runner = plane.runner("r1", "spot", crate::plane::STANDARD).await;
    runner.api.get(&path).await.assert_error(404, "not_found");
    let placed = org.post("/v1/sandboxes", json!({})).await;
    assert_eq!(placed.status, 201, "{placed:?}");
    assert_eq!(runner.api.get(&path).await.status, 200);
    runner
        .api
        .get(&format!("/v1/blocks/{other_id}/blocks/{digest}"))
        .await
        .assert_error(404, "not_found");

    // A tree is stored only once every object it names is there (so a
    // present tree always has its whole subtree), and a commit of a root
    // that is not there changes nothing.
    let mut entries = store::tree::Tree::default();
    entries.entries.push(store::tree::Entry {
        name: b"absent".to_vec(),
        mode: 0o644,
        size: 5,
        mtime_ns: 0,
        kind: store::tree::EntryKind::File {
            blocks: vec![store::Digest::of(b"never uploaded")],
        },
    });
    let (root, bytes) = entries.encode().expect("tree");
    let tree_path = format!("/v1/blocks/{org_id}/trees/{}", root.to_hex());
    let refused = put(org, tree_path.clone(), store::block::encode(&bytes)).await;
    refused.assert_error(409, "invalid_state");
    assert_eq!(refused.body["error"]["details"]["missing_objects"], 1);
    let commit = org
        .send(
            reqwest::Method::PUT,
            "/v1/images/broken",
            Some(serde_json::to_vec(&json!({"root": root.to_hex()})).expect("json")),
            &[],
        )
        .await
        .expect("request");
    commit.assert_error(409, "invalid_state");
    org.get("/v1/images/broken")
        .await
        .assert_error(404, "not_found");
    // With its block uploaded first, the same tree is accepted.
    let block = format!(
        "/v1/blocks/{org_id}/blocks/{}",
        store::Digest::of(b"never uploaded").to_hex()
    );
    assert_eq!(
        put(org, block, store::block::encode(b"never uploaded"))
            .await
            .status,
        204
    );
    assert_eq!(
        put(org, tree_path, store::block::encode(&bytes))
            .await
            .status,
        204
    );

    // Without a store the service says so.
    let bare = crate::plane::Plane::start(&[]).await;
    bare.org
        .get(&format!("/v1/blocks/{}/blocks/{digest}", bare.org_id))
        .await
        .assert_error(422, "unsupported_capability");
}

/// One frame of a batch body, written out by hand so that a change of the
/// wire format shows here: `KIND/HEX LENGTH\n` and the stored bytes.
fn frame(kind: &str, digest: &store::Digest, stored: &[u8]) -> Vec<u8> {
    let mut out = format!("{kind}/{} {}\n", digest.to_hex(), stored.len()).into_bytes();
    out.extend_from_slice(stored);
    out
}

fn block_frame(content: &[u8]) -> Vec<u8> {
    frame(
        "blocks",
        &store::Digest::of(content),
        &store::block::encode(content),
    )
}

/// A tree of one file per block in `contents`, named f0, f1, …: its
/// digest and stored bytes.
fn tree_of(contents: &[&[u8]]) -> (store::Digest, Vec<u8>) {
    let mut tree = store::tree::Tree::default();
    for (i, content) in contents.iter().enumerate() {
        tree.entries.push(store::tree::Entry {
            name: format!("f{i}").into_bytes(),
            mode: 0o644,
            size: content.len() as u64,
            mtime_ns: 0,
            kind: store::tree::EntryKind::File {
                blocks: vec![store::Digest::of(content)],
            },
        });
    }
    let (digest, bytes) = tree.encode().expect("tree");
    (digest, store::block::encode(&bytes))
}

/// Which of `names` (`blocks/HEX`, `trees/HEX`) the org's store lacks.
async fn missing(api: &Api, org_id: &str, names: &[String]) -> Value {
    let answer = api
        .post(
            &format!("/v1/blocks/{org_id}/missing"),
            json!({ "objects": names }),
        )
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    answer.body["missing"].clone()
}

fn name(kind: &str, content: &[u8]) -> String {
    format!("{kind}/{}", store::Digest::of(content).to_hex())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_service_stores_batches_in_order_and_refuses_bad_ones() {
    let store = tempfile::tempdir().expect("store dir");
    let store_arg = store.path().to_str().expect("utf-8").to_owned();
    let plane = crate::plane::Plane::start(&["--store", &store_arg]).await;
    let (org, org_id) = (&plane.org, &plane.org_id);
    let path = format!("/v1/blocks/{org_id}/batch");
    let post = |api: &Api, path: &str, body: Vec<u8>| {
        let (api, path) = (Api::new(&api.url, &api.token), path.to_owned());
        async move {
            api.send(reqwest::Method::POST, &path, Some(body), &[])
                .await
                .expect("request")
        }
    };
    let bytes_in = || metric(org, "roost_block_bytes_total{direction=\"in\"}");

    // Two blocks and, after them, the tree naming them: one request.
    let (a, b): (&[u8], &[u8]) = (b"batch block a", b"batch block b");
    let (tree, tree_stored) = tree_of(&[a, b]);
    let body = [
        block_frame(a),
        block_frame(b),
        frame("trees", &tree, &tree_stored),
    ]
    .concat();
    let before = bytes_in().await;
    let stored = post(org, &path, body).await;
    assert_eq!(stored.status, 204, "{stored:?}");
    let names = vec![
        name("blocks", a),
        name("blocks", b),
        format!("trees/{}", tree.to_hex()),
    ];
    assert_eq!(missing(org, org_id, &names).await, json!([]));
    for (name, content) in names[..2].iter().zip([a, b]) {
        let read = org.get(&format!("/v1/blocks/{org_id}/{name}")).await;
        assert_eq!(read.status, 200, "{read:?}");
        assert_eq!(
            store::block::decode(&store::Digest::of(content), &read.bytes).expect("decodes"),
            content
        );
    }
    // Counted as stored bytes, as the single PUT counts them.
    let stored_bytes = store::block::encode(a).len() + store::block::encode(b).len();
    assert_eq!(
        bytes_in().await - before,
        (stored_bytes + tree_stored.len()) as u64
    );

    // A bad hash anywhere refuses the whole batch: nothing of it stored.
    let (c, d): (&[u8], &[u8]) = (b"batch block c", b"batch block d");
    let forged = frame(
        "blocks",
        &store::Digest::of(d),
        &store::block::encode(b"not d"),
    );
    let refused = post(org, &path, [block_frame(c), forged].concat()).await;
    refused.assert_error(400, "invalid_request");
    assert_eq!(
        refused.body["error"]["details"]["digest_mismatch"],
        name("blocks", d)
    );
    let (c_name, d_name) = (name("blocks", c), name("blocks", d));
    assert_eq!(
        missing(org, org_id, &[c_name.clone(), d_name.clone()]).await,
        json!([c_name, d_name])
    );

    // A tree is taken only with its children stored or earlier in the same
    // batch: after them it is, before them it is not (and neither are they).
    let (e, f): (&[u8], &[u8]) = (b"batch block e", b"batch block f");
    let (early, early_stored) = tree_of(&[e, f]);
    let refused = post(
        org,
        &path,
        [
            block_frame(e),
            frame("trees", &early, &early_stored),
            block_frame(f),
        ]
        .concat(),
    )
    .await;
    refused.assert_error(409, "invalid_state");
    assert_eq!(refused.body["error"]["details"]["missing_objects"], 1);
    assert_eq!(
        refused.body["error"]["details"]["object"],
        format!("trees/{}", early.to_hex())
    );
    let early_names = vec![
        name("blocks", e),
        name("blocks", f),
        format!("trees/{}", early.to_hex()),
    ];
    assert_eq!(missing(org, org_id, &early_names).await, json!(early_names));
    // A tree whose children are already stored needs only itself.
    let (again, again_stored) = tree_of(&[b, a]);
    let stored = post(org, &path, frame("trees", &again, &again_stored)).await;
    assert_eq!(stored.status, 204, "{stored:?}");

    // Hostile framing: 400 (413 for an oversized body), nothing stored.
    let g: &[u8] = b"batch block g";
    let g_frame = block_frame(g);
    let g_stored = store::block::encode(g);
    let g_hex = store::Digest::of(g).to_hex();
    let long = [
        format!("blocks/{g_hex} {}\n", g_stored.len() + 5).into_bytes(),
        g_stored.clone(),
    ]
    .concat();
    let short = [
        format!("blocks/{g_hex} {}\n", g_stored.len() - 1).into_bytes(),
        g_stored.clone(),
    ]
    .concat();
    let unknown = frame("snapshots", &store::Digest::of(g), &g_stored);
    let empty_block = block_frame(b"");
    let too_many: Vec<u8> = std::iter::repeat_n(empty_block, 1025).flatten().collect();
    for (what, body) in [
        (
            "truncated header",
            [g_frame.clone(), b"blocks/ab".to_vec()].concat(),
        ),
        ("truncated data", g_frame[..g_frame.len() - 3].to_vec()),
        ("length past the end", long),
        ("length short of the data", short),
        ("unknown kind", unknown),
        ("no length", format!("blocks/{g_hex}\n").into_bytes()),
        ("too many objects", too_many),
    ] {
        let refused = post(org, &path, body).await;
        assert_eq!(refused.status, 400, "{what}: {refused:?}");
        refused.assert_error(400, "invalid_request");
        assert_eq!(refused.body["error"]["details"]["field"], "body", "{what}");
    }
    let oversized = frame(
        "blocks",
        &store::Digest::of(g),
        &vec![0; api::blocks::BATCH_BODY_BYTES_MAX],
    );
    post(org, &path, oversized)
        .await
        .assert_error(413, "payload_too_large");
    assert_eq!(
        missing(org, org_id, &[name("blocks", g)]).await,
        json!([name("blocks", g)])
    );

    // Another org's token cannot write into this org, nor read what its
    // own batch stored elsewhere; a runner can write once it runs a
    // sandbox of the org (saves), not before.
    let (other, other_id) = new_org(&plane.admin, "other", json!({})).await;
    post(&other, &path, g_frame.clone())
        .await
        .assert_error(404, "not_found");
    assert_eq!(
        missing(org, org_id, &[name("blocks", g)]).await,
        json!([name("blocks", g)])
    );
    let other_path = format!("/v1/blocks/{other_id}/batch");
    assert_eq!(post(&other, &other_path, g_frame.clone()).await.status, 204);
    assert_eq!(
        missing(org, org_id, &[name("blocks", g)]).await,
        json!([name("blocks", g)]),
        "an object stored for one org is not in another"
    );
    let runner = plane.runner("r1", "spot", crate::plane::STANDARD).await;
    post(&runner.api, &path, g_frame.clone())
        .await
        .assert_error(404, "not_found");
    let placed = org.post("/v1/sandboxes", json!({})).await;
    assert_eq!(placed.status, 201, "{placed:?}");
    assert_eq!(post(&runner.api, &path, g_frame.clone()).await.status, 204);
    assert_eq!(missing(org, org_id, &[name("blocks", g)]).await, json!([]));

    // The batch is in the API description.
    let openapi = org.get("/v1/openapi.json").await;
    assert!(
        openapi.body["paths"]["/v1/blocks/{org}/batch"]["post"].is_object(),
        "{}",
        openapi.body["paths"]
    );

    // Without a store the service says so.
    let bare = crate::plane::Plane::start(&[]).await;
    post(
        &bare.org,
        &format!("/v1/blocks/{}/batch", bare.org_id),
        g_frame,
    )
    .await
    .assert_error(422, "unsupported_capability");
}

/// Block-service upload requests the server has answered (single PUTs and
/// batches, whatever their status).
async fn upload_requests(api: &Api) -> u64 {
    metric(
        api,
        "roost_http_requests_total{method=\"PUT\",route=\"/v1/blocks/{org}/{kind}/{hex}\"",
    )
    .await
        + batch_requests(api).await
}

async fn batch_requests(api: &Api) -> u64 {
    metric(
        api,
        "roost_http_requests_total{method=\"POST\",route=\"/v1/blocks/{org}/batch\"",
    )
    .await
}

/// Stops the sandbox (its home is secured: saved through the block
/// service and committed) and returns the upload requests that took.
async fn secure(api: &Api, id: &str) -> u64 {
    let before = upload_requests(api).await;
    let stop = api
        .post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    assert_eq!(stop.status, 202, "{stop:?}");
    let stopped = wait_sandbox(api, id, "stopped").await;
    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert_eq!(stopped["save"]["state"], "ok", "{stopped}");
    upload_requests(api).await - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_of_many_changed_files_takes_few_block_service_requests() {
    const DIRS: usize = 20;
    const FILES: usize = 30;
    let store = tempfile::tempdir().expect("store dir");
    let store_arg = store.path().to_str().expect("utf-8").to_owned();
    let stack = Stack::start_full(&["--store", &store_arg], &[]).await;
    let api = stack.api();
    let sandbox = stack
        .running_sandbox(json!({"storage_class": "durable"}))
        .await;
    let id = sandbox["id"].as_str().expect("id");

    // 600 small distinct files in 20 directories: at least 600 blocks and
    // 22 trees to upload.
    let write = |version: &str, every: usize| {
        format!(
            "cd /workspace && d=0; while [ $d -lt {DIRS} ]; do mkdir -p src/d$d; f=0; \
             while [ $f -lt {FILES} ]; do if [ $((f % {every})) -eq 0 ]; then \
             echo \"$d/$f {version}\" > src/d$d/f$f; fi; f=$((f + 1)); done; d=$((d + 1)); done"
        )
    };
    sh(api, id, &write("v1", 1)).await;
    let batches = batch_requests(api).await;
    let requests = secure(api, id).await;
    assert!(
        batch_requests(api).await > batches,
        "the save did not use the batch upload"
    );
    assert!(
        (1..=12).contains(&requests),
        "{requests} upload requests for over {} objects",
        DIRS * FILES + DIRS + 2
    );

    // A third of the files change: 200 blocks and 22 trees, a few requests.
    let start = api
        .post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    assert_eq!(start.status, 202, "{start:?}");
    assert_eq!(wait_sandbox(api, id, "running").await["state"], "running");
    sh(api, id, &write("v2", 3)).await;
    let requests = secure(api, id).await;
    assert!(
        (1..=8).contains(&requests),
        "{requests} upload requests for over {} objects",
        DIRS * FILES / 3 + DIRS + 2
    );

    // The saved home is the one written: it comes back on start.
    api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    assert_eq!(wait_sandbox(api, id, "running").await["state"], "running");
    assert_eq!(
        sh(api, id, "cat /workspace/src/d7/f9 /workspace/src/d7/f10").await,
        "7/9 v2\n7/10 v1\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_service_hands_out_objects_in_batches_naming_absent_ones() {
    let store = tempfile::tempdir().expect("store dir");
    let store_arg = store.path().to_str().expect("utf-8").to_owned();
    let plane = crate::plane::Plane::start(&["--store", &store_arg]).await;
    let (org, org_id) = (&plane.org, &plane.org_id);
    let fetch = format!("/v1/blocks/{org_id}/fetch");
    let (a, b): (&[u8], &[u8]) = (b"fetched block a", b"fetched block b");
    let (tree, tree_stored) = tree_of(&[a, b]);
    let upload = [
        block_frame(a),
        block_frame(b),
        frame("trees", &tree, &tree_stored),
    ]
    .concat();
    let stored = org
        .send(
            reqwest::Method::POST,
            &format!("/v1/blocks/{org_id}/batch"),
            Some(upload),
            &[],
        )
        .await
        .expect("request");
    assert_eq!(stored.status, 204, "{stored:?}");

    // In the order asked, an absent object as its header with `-`.
    let absent = name("blocks", b"never stored");
    let tree_name = format!("trees/{}", tree.to_hex());
    let objects_out = || metric(org, "roost_block_objects_total{direction=\"out\"}");
    let before = objects_out().await;
    let answer = org
        .post(
            &fetch,
            json!({"objects": [name("blocks", b), absent, tree_name, name("blocks", a)]}),
        )
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let expected = [
        block_frame(b),
        format!("{absent} -\n").into_bytes(),
        frame("trees", &tree, &tree_stored),
        block_frame(a),
    ]
    .concat();
    assert_eq!(
        String::from_utf8_lossy(&answer.bytes),
        String::from_utf8_lossy(&expected)
    );
    assert_eq!(objects_out().await - before, 3, "three objects handed out");

    // Another org's token finds nothing of this org; bad requests are named.
    let (other, _) = new_org(&plane.admin, "other", json!({})).await;
    other
        .post(&fetch, json!({"objects": [name("blocks", a)]}))
        .await
        .assert_error(404, "not_found");
    org.post(&fetch, json!({"objects": []}))
        .await
        .assert_error(400, "invalid_request");
    let too_many: Vec<String> = (0..1025)
        .map(|i| name("blocks", format!("{i}").as_bytes()))
        .collect();
    org.post(&fetch, json!({"objects": too_many}))
        .await
        .assert_error(400, "invalid_request");
    let bad = org
        .post(&fetch, json!({"objects": ["blocks/nothex"]}))
        .await;
    bad.assert_error(400, "invalid_request");
    assert_eq!(bad.body["error"]["details"]["field"], "objects");

    // Three incompressible 4 MiB blocks: an answer stops once it holds
    // 8 MiB, and the runners' client asks again for the rest.
    let big: Vec<Vec<u8>> = (1..=3)
        .map(|seed| crate::harness::bytes(seed, 4 << 20))
        .collect();
    let big_names: Vec<String> = big.iter().map(|content| name("blocks", content)).collect();
    for (content, name) in big.iter().zip(&big_names) {
        let put = org
            .send(
                reqwest::Method::PUT,
                &format!("/v1/blocks/{org_id}/{name}"),
                Some(store::block::encode(content)),
                &[],
            )
            .await
            .expect("request");
        assert_eq!(put.status, 204, "{put:?}");
    }
    let answer = org.post(&fetch, json!({ "objects": big_names })).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let frames = api::blocks::parse_fetched(&answer.bytes).expect("frames");
    assert_eq!(frames.len(), 2, "the answer stops after 8 MiB");
    let mut objects: Vec<store::store::ObjectId> = big
        .iter()
        .map(|content| store::store::ObjectId::block(store::Digest::of(content)))
        .collect();
    objects.push(store::store::ObjectId::block(store::Digest::of(
        b"never stored",
    )));
    let backend = api::blocks::RemoteBackend::new(
        api::client::Client::new(&org.url, &org.token),
        tokio::runtime::Handle::current(),
    );
    let org_id: store::OrgId = org_id.parse().expect("org id");
    let got = tokio::task::spawn_blocking(move || {
        use store::Objects;
        backend.get_batch(&org_id, &objects)
    })
    .await
    .expect("task")
    .expect("get_batch");
    assert_eq!(got.len(), 4);
    for (content, stored) in big.iter().zip(&got) {
        let stored = stored.as_ref().expect("present");
        assert_eq!(
            &store::block::decode(&store::Digest::of(content), stored).expect("decodes"),
            content
        );
    }
    assert_eq!(got[3], None, "absent");
}

/// An image commit pins its tree, then writes its record: one killed
/// between the two (a server's crash) leaves the record naming the tree
/// it named, and gc keeps that tree whole; the next commit then works as
/// ever. Before, the commit pointed the image's only pin at its new tree
/// first, and gc took the tree the record still named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_commit_killed_before_its_record_leaves_the_recorded_tree_to_gc_never() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let store_dir = tmp.path().join("store");
    let store_arg = store_dir.to_str().expect("utf-8").to_owned();
    let args = ["--store", store_arg.as_str()];
    let server = crate::plane::start_server_with(&data, &args, &[]);
    let admin = Api::new(&server.url, server.admin_token.as_deref().expect("token"));
    let (org, org_id) = new_org(&admin, "acme", json!({})).await;

    let tree = tmp.path().join("tree");
    std::fs::create_dir_all(tree.join("etc")).expect("etc");
    std::fs::write(tree.join("etc/os-release"), "ID=first\n").expect("write");
    std::fs::write(tree.join("etc/motd"), "the first version\n").expect("write");
    let first = import(&org, "base", &tree)["image"]["root"]
        .as_str()
        .expect("a root")
        .to_owned();

    // The second version's commit dies between its pin and its record.
    drop(server);
    let mut crashing =
        crate::plane::start_server_with(&data, &args, &[("ROOST_FAILPOINT", "image:after_pin")]);
    let org = Api::new(&crashing.url, &org.token);
    std::fs::write(tree.join("etc/os-release"), "ID=second\n").expect("write");
    std::fs::write(tree.join("etc/motd"), "the second version\n").expect("write");
    let died = Command::new(BIN)
        .args(["image", "import", "base"])
        .arg(&tree)
        .args(["--json", "--url", &org.url, "--token", &org.token])
        .output()
        .expect("roost image import");
    assert!(!died.status.success(), "the server died before answering");
    let status = crashing.child.wait().expect("wait");
    assert!(!status.success(), "killed at the failpoint");

    let server = crate::plane::start_server_with(&data, &args, &[]);
    let org = Api::new(&server.url, &org.token);
    let recorded = org.get("/v1/images/base").await;
    assert_eq!(recorded.body["root"], first.as_str(), "{recorded:?}");

    gc_with_no_grace(&store_arg);
    // The recorded tree is whole: pulled through a pin of its own.
    let pulled = pull_root(&store_arg, &org_id, &first, &tmp.path().join("first"));
    assert_eq!(
        std::fs::read_to_string(pulled.join("etc/motd")).expect("motd"),
        "the first version\n"
    );

    // The next commit of the same version works, and is what gc keeps.
    let second = import(&org, "base", &tree)["image"]["root"]
        .as_str()
        .expect("a root")
        .to_owned();
    assert_ne!(second, first);
    assert_eq!(
        org.get("/v1/images/base").await.body["root"],
        second.as_str()
    );
    gc_with_no_grace(&store_arg);
    let pulled = pull_root(&store_arg, &org_id, &second, &tmp.path().join("second"));
    assert_eq!(
        std::fs::read_to_string(pulled.join("etc/os-release")).expect("os-release"),
        "ID=second\n"
    );
}

/// `roost store gc` with no grace: whatever no pin names goes.
fn gc_with_no_grace(store: &str) {
    let gc = Command::new(BIN)
        .args(["store", "gc", "--store", store, "--grace", "0s", "--json"])
        .output()
        .expect("roost store gc");
    assert!(
        gc.status.success(),
        "{}",
        String::from_utf8_lossy(&gc.stderr)
    );
}

/// Pulls tree `root` of `org` into `dest` through a pin named after
/// `dest`'s last component (written straight into the store for it).
fn pull_root(store: &str, org: &str, root: &str, dest: &Path) -> std::path::PathBuf {
    let name = dest.file_name().and_then(|n| n.to_str()).expect("a name");
    let home: store::HomeName = format!("probe-{name}").parse().expect("a home name");
    let opened = store::Store::open_existing(store).expect("the store");
    let org_id: store::OrgId = org.parse().expect("an org");
    opened
        .write_home(&org_id, &home, &root.parse().expect("a digest"))
        .expect("a pin");
    let output = Command::new(BIN)
        .args(["home", "pull"])
        .arg(dest)
        .args([
            "--store",
            store,
            "--org",
            org,
            "--home",
            home.as_str(),
            "--json",
        ])
        .output()
        .expect("roost home pull");
    assert!(
        output.status.success(),
        "pull of {root}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    dest.to_path_buf()
}
