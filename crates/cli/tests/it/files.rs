//! Issue 15, point 5: a sandbox's files through the API and `roost files`,
//! for real: a `roost server`, a `roost runner` driving runc, the
//! sandbox's agent doing every operation inside the sandbox. Bytes go
//! client → server → the runner's data listener → the agent and back,
//! streamed; what the sandbox holds is checked from inside it (`sh`).

use std::path::Path;
use std::process::{Command, Output, Stdio};

use serde_json::{Value, json};

use crate::harness::{BIN, assert_plain_stderr, message_lines};
use crate::plane::Api;
use crate::runner_e2e::{Stack, data_url, sh, wait_sandbox};

/// `roost ARGS` against the stack's server with the org's token.
fn roost(api: &Api, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("ROOST_URL", &api.url)
        .env("ROOST_TOKEN", &api.token)
        .stdin(Stdio::null())
        .output()
        .expect("roost")
}

/// `roost ARGS --json`, which must succeed: its one JSON document.
fn roost_json(api: &Api, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let ran = roost(api, &all);
    assert!(ran.status.success(), "roost {args:?}: {ran:?}");
    assert_plain_stderr(&all, &ran.stderr);
    serde_json::from_slice(&ran.stdout).unwrap_or_else(|e| panic!("roost {args:?}: {e}: {ran:?}"))
}

/// `sha256sum`'s digest of a local file.
fn sha256(path: &Path) -> String {
    let output = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    assert!(output.status.success(), "{output:?}");
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .expect("digest")
        .to_owned()
}

/// `bytes` of noise (deterministic, incompressible enough), written in
/// chunks so no test holds it whole.
fn noise_file(path: &Path, bytes: u64) {
    use std::io::Write;
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).expect("create"));
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut chunk = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        for byte in chunk.iter_mut() {
            // xorshift64
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *byte = state as u8;
        }
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n]).expect("write");
        left -= n as u64;
    }
    file.flush().expect("flush");
}

/// A request with raw bytes and headers.
pub(crate) async fn send(
    api: &Api,
    method: reqwest::Method,
    path: &str,
    body: Option<Vec<u8>>,
    headers: &[(&str, &str)],
) -> crate::plane::Answer {
    let mut request = reqwest::Client::new()
        .request(method, format!("{}{path}", api.url))
        .bearer_auth(&api.token);
    if let Some(body) = body {
        request = request.body(body);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let bytes = response.bytes().await.expect("body").to_vec();
    crate::plane::Answer {
        status,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        request_id,
        retry_after: None,
        replayed: false,
        headers,
        bytes,
    }
}

fn header<'a>(answer: &'a crate::plane::Answer, name: &str) -> &'a str {
    answer
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no {name} in {answer:?}"))
}

/// Issue 15, point 5: 200 MiB up and back down through `roost files`
/// (the same digest on both sides and in the sandbox), ranges (206 with
/// `Content-Range`, 416 past the end), and ls, rm, mv, mkdir with their
/// answers; a write is 201 when new and 200 when it replaced a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_go_up_and_down_whole_by_range_and_are_listed_moved_and_removed() {
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let dir = tempfile::tempdir().expect("tempdir");

    // 200 MiB up and down: one digest everywhere.
    let big = dir.path().join("big.bin");
    noise_file(&big, 200 << 20);
    let digest = sha256(&big);
    let big_arg = big.to_str().expect("utf-8");
    let written = roost_json(
        &api,
        &[
            "files",
            "put",
            &sid,
            big_arg,
            "/workspace/data/big.bin",
            "-p",
        ],
    );
    assert_eq!(
        written,
        json!({"path": "/workspace/data/big.bin", "size": 200u64 << 20})
    );
    let inside = sh(&api, &sid, "sha256sum /workspace/data/big.bin").await;
    assert_eq!(inside.split_whitespace().next(), Some(digest.as_str()));
    let back = dir.path().join("back.bin");
    let got = roost_json(
        &api,
        &[
            "files",
            "get",
            &sid,
            "data/big.bin",
            back.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(got["bytes"], 200u64 << 20, "{got}");
    assert_eq!(sha256(&back), digest);
    assert!(!dir.path().join("back.bin.roost-part").exists());

    // Made, then replaced; the mode asked for, as the sandbox sees it.
    let small = dir.path().join("small.txt");
    std::fs::write(&small, "0123456789abcdefghij").expect("write");
    let small_arg = small.to_str().expect("utf-8");
    let path = format!("/v1/sandboxes/{sid}/files?path=/workspace/small.txt&mode=0640");
    let made = send(
        &api,
        reqwest::Method::PUT,
        &path,
        Some(b"first".to_vec()),
        &[],
    )
    .await;
    assert_eq!(made.status, 201, "{made:?}");
    let replaced = roost_json(
        &api,
        &[
            "files",
            "put",
            &sid,
            small_arg,
            "small.txt",
            "--mode",
            "0640",
        ],
    );
    assert_eq!(replaced["size"], 20);
    assert_eq!(
        sh(&api, &sid, "stat -c %a /workspace/small.txt")
            .await
            .trim(),
        "640"
    );
    let again = send(
        &api,
        reqwest::Method::PUT,
        &path,
        Some(b"0123456789abcdefghij".to_vec()),
        &[],
    )
    .await;
    assert_eq!(again.status, 200, "{again:?}");

    // Ranges.
    let file = format!("/v1/sandboxes/{sid}/files?path=small.txt");
    let whole = send(&api, reqwest::Method::GET, &file, None, &[]).await;
    assert_eq!(whole.status, 200, "{whole:?}");
    assert_eq!(whole.bytes, b"0123456789abcdefghij");
    assert_eq!(header(&whole, "x-roost-mode"), "0640");
    assert_eq!(header(&whole, "x-roost-size"), "20");
    assert_eq!(header(&whole, "content-length"), "20");
    assert!(
        header(&whole, "last-modified").ends_with(" GMT"),
        "{whole:?}"
    );
    for (range, status, body, content_range) in [
        ("bytes=2-5", 206, &b"2345"[..], Some("bytes 2-5/20")),
        ("bytes=15-", 206, b"fghij", Some("bytes 15-19/20")),
        ("bytes=-3", 206, b"hij", Some("bytes 17-19/20")),
        ("bytes=18-400", 206, b"ij", Some("bytes 18-19/20")),
        // Not one range we take: the whole file.
        ("bytes=0-1,4-5", 200, b"0123456789abcdefghij", None),
    ] {
        let answer = send(&api, reqwest::Method::GET, &file, None, &[("range", range)]).await;
        assert_eq!(answer.status, status, "{range}: {answer:?}");
        assert_eq!(answer.bytes, body, "{range}");
        assert_eq!(
            answer
                .headers
                .get("content-range")
                .and_then(|v| v.to_str().ok()),
            content_range,
            "{range}"
        );
    }
    for range in ["bytes=20-", "bytes=25-30"] {
        let past = send(&api, reqwest::Method::GET, &file, None, &[("range", range)]).await;
        past.assert_error(416, "range_not_satisfiable");
        assert_eq!(header(&past, "content-range"), "bytes */20", "{range}");
        assert_eq!(past.body["error"]["details"]["size"], 20);
    }
    let ranged = roost(
        &api,
        &["files", "get", &sid, "small.txt", "-", "--range", "10-12"],
    );
    assert!(ranged.status.success(), "{ranged:?}");
    assert_eq!(ranged.stdout, b"abc");

    // A download interrupted (here: a part left by hand) resumes.
    let resumed = dir.path().join("resumed.txt");
    std::fs::write(dir.path().join("resumed.txt.roost-part"), "0123456").expect("part");
    roost_json(
        &api,
        &[
            "files",
            "get",
            &sid,
            "small.txt",
            resumed.to_str().expect("utf-8"),
            "--resume",
        ],
    );
    assert_eq!(
        std::fs::read_to_string(&resumed).expect("resumed"),
        "0123456789abcdefghij"
    );

    // mkdir, mv, ls, rm.
    let made = roost_json(&api, &["files", "mkdir", &sid, "/workspace/a/b/c", "-p"]);
    assert_eq!(made, json!({"path": "/workspace/a/b/c", "created": true}));
    let exists = roost(&api, &["files", "mkdir", &sid, "/workspace/a/b/c"]);
    assert!(!exists.status.success());
    let stderr = String::from_utf8_lossy(&exists.stderr);
    assert!(
        stderr.contains("invalid_state") && stderr.contains("/workspace/a/b/c"),
        "{stderr}"
    );
    assert_eq!(message_lines(&stderr).len(), 1, "{stderr}");
    let moved = roost_json(
        &api,
        &[
            "files",
            "mv",
            &sid,
            "small.txt",
            "/workspace/a/b/c/moved.txt",
        ],
    );
    assert_eq!(
        moved,
        json!({"from": "small.txt", "to": "/workspace/a/b/c/moved.txt"})
    );
    sh(&api, &sid, "ln -s moved.txt /workspace/a/b/c/link").await;
    let list = roost_json(&api, &["files", "ls", &sid, "/workspace/a", "--depth", "3"]);
    let entries: Vec<(&str, &str)> = list["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| {
            (
                e["path"].as_str().unwrap_or(""),
                e["type"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        entries,
        vec![
            ("/workspace/a/b", "directory"),
            ("/workspace/a/b/c", "directory"),
            ("/workspace/a/b/c/link", "symlink"),
            ("/workspace/a/b/c/moved.txt", "file"),
        ],
        "{list}"
    );
    assert_eq!(list["truncated"], false);
    let link = &list["entries"][2];
    assert_eq!(link["link_target"], "moved.txt");
    let moved_entry = &list["entries"][3];
    assert_eq!(moved_entry["size"], 20);
    assert_eq!(moved_entry["mode"], "0640");
    assert!(
        moved_entry["modified_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{moved_entry}"
    );
    let table = roost(&api, &["files", "ls", &sid, "/workspace/a/b/c"]);
    assert!(table.status.success(), "{table:?}");
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.starts_with("TYPE"), "{table}");
    assert!(
        table.contains("/workspace/a/b/c/link -> moved.txt"),
        "{table}"
    );
    let not_empty = roost(&api, &["files", "rm", &sid, "/workspace/a"]);
    assert!(!not_empty.status.success(), "{not_empty:?}");
    assert_eq!(
        roost_json(&api, &["files", "rm", &sid, "/workspace/a", "-r"]),
        json!({"path": "/workspace/a"})
    );
    let gone = send(
        &api,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{sid}/files/list?path=/workspace/a"),
        None,
        &[],
    )
    .await;
    gone.assert_error(404, "not_found");
    let directory = send(
        &api,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{sid}/files?path=/workspace/data"),
        None,
        &[],
    )
    .await;
    directory.assert_error(409, "invalid_state");
    assert_eq!(
        directory.body["error"]["details"]["reason"],
        "is_a_directory"
    );
    stack.runner.assert_no_errors();
}

/// Issue 15, point 5: a directory of 2,000 files (nested, with a symlink
/// and an executable) goes up through `roost files put` (one tar stream)
/// and comes back through `roost files get` the same, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_of_two_thousand_files_goes_through_the_tar_path_both_ways() {
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let tree = dir.path().join("tree");
    for i in 0..2000 {
        let sub = tree.join(format!("d{:02}", i % 40));
        std::fs::create_dir_all(&sub).expect("dir");
        std::fs::write(
            sub.join(format!("f{i}.txt")),
            format!("file {i}\n").repeat(i % 7 + 1),
        )
        .expect("file");
    }
    std::os::unix::fs::symlink("d00/f0.txt", tree.join("link")).expect("symlink");
    let tool = tree.join("d01/tool.sh");
    std::fs::write(&tool, "#!/bin/sh\necho tool\n").expect("tool");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    let put = roost_json(
        &api,
        &[
            "files",
            "put",
            &sid,
            tree.to_str().expect("utf-8"),
            "/workspace/tree",
        ],
    );
    assert_eq!(put["files"], 2001, "{put}");
    assert_eq!(put["symlinks"], 1, "{put}");
    assert_eq!(put["skipped"], 0, "{put}");
    let counted = sh(
        &api,
        &sid,
        "find /workspace/tree -type f | wc -l; readlink /workspace/tree/link; /workspace/tree/d01/tool.sh",
    )
    .await;
    assert_eq!(counted, "2001\nd00/f0.txt\ntool\n");

    let back = dir.path().join("back");
    let got = roost_json(
        &api,
        &[
            "files",
            "get",
            &sid,
            "/workspace/tree",
            back.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(got["type"], "directory", "{got}");
    assert_eq!(got["files"], 2001, "{got}");
    let diff = Command::new("diff")
        .arg("-r")
        .arg("--no-dereference")
        .arg(&tree)
        .arg(&back)
        .output()
        .expect("diff");
    assert!(diff.status.success(), "{diff:?}");
    assert_eq!(
        std::fs::read_link(back.join("link")).expect("link"),
        Path::new("d00/f0.txt")
    );
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(back.join("d01/tool.sh"))
            .expect("tool")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
    }
    stack.runner.assert_no_errors();
}

/// Issue 15, point 5: a full disk (the sandbox's 64 MiB `/dev/shm`) is
/// 507 `insufficient_storage`, through the API and the CLI, and leaves
/// nothing under the final name: a new file is absent, a replaced one
/// keeps its old content, no temporary file stays behind; the tar path
/// answers the same. Regression: a refusal sent before the body was all
/// read reached the client as a reset connection (503 at the server)
/// instead of its code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_507_and_leaves_nothing_under_the_final_name() {
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let big = dir.path().join("big.bin");
    noise_file(&big, 100 << 20);
    let big_arg = big.to_str().expect("utf-8");

    let full = roost(&api, &["files", "put", &sid, big_arg, "/dev/shm/big.bin"]);
    assert!(!full.status.success(), "{full:?}");
    let stderr = String::from_utf8_lossy(&full.stderr);
    assert!(
        stderr.contains("insufficient_storage") && stderr.contains("/dev/shm/big.bin"),
        "{stderr}"
    );
    sh(&api, &sid, "echo old > /dev/shm/kept.txt").await;
    let answer = send(
        &api,
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{sid}/files?path=/dev/shm/kept.txt"),
        Some(std::fs::read(&big).expect("read")),
        &[],
    )
    .await;
    answer.assert_error(507, "insufficient_storage");
    // A refusal before any byte is taken (no such directory; another
    // org's sandbox) still reaches the client whole, however large the
    // body it did not want.
    let body = std::fs::read(&big).expect("read");
    let early = send(
        &api,
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{sid}/files?path=/workspace/no/such/dir/x"),
        Some(body.clone()),
        &[],
    )
    .await;
    early.assert_error(404, "not_found");
    let (other, _) = crate::plane::new_org(&stack.plane.admin, "org-full", json!({})).await;
    let hidden = send(
        &other,
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{sid}/files/tar?path=/workspace"),
        Some(body),
        &[],
    )
    .await;
    hidden.assert_error(404, "not_found");
    assert_eq!(
        sh(&api, &sid, "ls -a /dev/shm; cat /dev/shm/kept.txt").await,
        ".\n..\nkept.txt\nold\n"
    );

    // The same through the tar path: a 507, and the disk free again.
    let tree = dir.path().join("tree");
    std::fs::create_dir_all(&tree).expect("tree");
    std::fs::rename(&big, tree.join("big.bin")).expect("move");
    let unpack = roost(
        &api,
        &[
            "files",
            "put",
            &sid,
            tree.to_str().expect("utf-8"),
            "/dev/shm/tree",
        ],
    );
    assert!(!unpack.status.success(), "{unpack:?}");
    let stderr = String::from_utf8_lossy(&unpack.stderr);
    assert!(stderr.contains("insufficient_storage"), "{stderr}");
    assert_eq!(
        sh(&api, &sid, "find /dev/shm/tree -type f | wc -l").await,
        "0\n"
    );
    stack.runner.assert_no_errors();
}

/// Issue 15, point 5 and "Bad input": a `..` path and a NUL byte are 400
/// naming the path (nothing reaches the runner), another org's sandbox
/// 404, a stopped sandbox 409; the runner's data listener answers every
/// files route 401 without a token, with a forged one, and with one
/// minted for another operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_paths_other_orgs_stopped_sandboxes_and_forged_tokens_are_refused() {
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let files = format!("/v1/sandboxes/{sid}/files");

    for (method, path, body) in [
        (
            reqwest::Method::GET,
            format!("{files}?path=/workspace/../etc/passwd"),
            None,
        ),
        (reqwest::Method::GET, format!("{files}?path=a%00b"), None),
        (
            reqwest::Method::PUT,
            format!("{files}?path=../x"),
            Some(b"x".to_vec()),
        ),
        (
            reqwest::Method::DELETE,
            format!("{files}?path=/tmp/.."),
            None,
        ),
        (reqwest::Method::GET, format!("{files}/list?path=.."), None),
        (
            reqwest::Method::GET,
            format!("{files}/tar?path=x/../.."),
            None,
        ),
        (
            reqwest::Method::PUT,
            format!("{files}/tar?path=a%00"),
            Some(Vec::new()),
        ),
        (
            reqwest::Method::PUT,
            format!("{files}?path=/workspace/x&mode=4755"),
            Some(b"x".to_vec()),
        ),
        (
            reqwest::Method::GET,
            format!("{files}/list?path=/&depth=17"),
            None,
        ),
    ] {
        let answer = send(&api, method.clone(), &path, body, &[]).await;
        answer.assert_error(400, "invalid_request");
        let message = answer.body["error"]["message"].as_str().unwrap_or("");
        assert!(
            message.contains("path") || message.contains("mode") || message.contains("depth"),
            "{method} {path}: {message}"
        );
    }
    let moved = api
        .post(
            &format!("{files}/move"),
            json!({"from": "/workspace/a", "to": "/workspace/../../b"}),
        )
        .await;
    moved.assert_error(400, "invalid_request");
    let made = api
        .post(&format!("{files}/mkdir"), json!({"path": "x\u{0}y"}))
        .await;
    made.assert_error(400, "invalid_request");
    let ran = roost(
        &api,
        &["files", "get", &sid, "/workspace/../etc/shadow", "-"],
    );
    assert!(!ran.status.success());
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(
        stderr.contains("`..`") && message_lines(&stderr).len() == 1,
        "{stderr}"
    );
    // Nothing was made by any of them.
    assert_eq!(sh(&api, &sid, "ls -A /workspace").await, "");

    // Another org: no such sandbox, whatever the operation.
    let (other, _) = crate::plane::new_org(&stack.plane.admin, "org-files", json!({})).await;
    let hidden = send(
        &other,
        reqwest::Method::GET,
        &format!("{files}?path=/etc/hostname"),
        None,
        &[],
    )
    .await;
    hidden.assert_error(404, "not_found");
    let hidden = send(
        &other,
        reqwest::Method::PUT,
        &format!("{files}?path=/workspace/planted"),
        Some(b"x".to_vec()),
        &[],
    )
    .await;
    hidden.assert_error(404, "not_found");
    let hidden = other
        .post(
            &format!("{files}/mkdir"),
            json!({"path": "/workspace/planted"}),
        )
        .await;
    hidden.assert_error(404, "not_found");
    let listed = roost(&other, &["files", "ls", &sid, "/"]);
    assert!(!listed.status.success());
    assert!(String::from_utf8_lossy(&listed.stderr).contains("not_found"));

    // The runner's data listener: no token, a forged one, one for another
    // operation or a command: 401 on every files route, nothing done.
    let runner = format!("{}/v1/data/sandboxes/{sid}/files", data_url(&stack.runner));
    let http = reqwest::Client::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_millis() as u64;
    let forged = api::data_path::mint(
        &api::data_path::new_key().expect("key"),
        &api::data_path::DataClaims {
            sandbox_id: sid.clone(),
            epoch: sandbox["epoch"].as_u64().expect("epoch"),
            op: api::files::ops::WRITE.to_owned(),
            command_id: None,
            subject: None,
            org_id: None,
            expires_unix_ms: now + 30_000,
        },
    );
    for (method, url) in [
        (reqwest::Method::GET, format!("{runner}?path=/etc/hostname")),
        (
            reqwest::Method::PUT,
            format!("{runner}?path=/workspace/planted"),
        ),
        (reqwest::Method::DELETE, format!("{runner}?path=/workspace")),
        (reqwest::Method::GET, format!("{runner}/list?path=/")),
        (reqwest::Method::POST, format!("{runner}/move")),
        (reqwest::Method::POST, format!("{runner}/mkdir")),
        (reqwest::Method::GET, format!("{runner}/tar?path=/etc")),
        (
            reqwest::Method::PUT,
            format!("{runner}/tar?path=/workspace"),
        ),
    ] {
        for token in [None, Some(forged.as_str()), Some("roost-data-v1.e30.00")] {
            let mut request = http.request(method.clone(), &url).body("{}");
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let answer = request.send().await.expect("send");
            assert_eq!(answer.status(), 401, "{method} {url} with {token:?}");
        }
    }
    assert_eq!(sh(&api, &sid, "ls -A /workspace").await, "");

    // Stopped: its files are out of reach until it runs again.
    let stopped = api
        .post(&format!("/v1/sandboxes/{sid}/stop"), json!({}))
        .await;
    assert!(stopped.status < 300, "{stopped:?}");
    let sandbox = wait_sandbox(&api, &sid, "stopped").await;
    assert_eq!(sandbox["state"], "stopped", "{sandbox}");
    let refused = send(
        &api,
        reqwest::Method::GET,
        &format!("{files}?path=/etc/hostname"),
        None,
        &[],
    )
    .await;
    refused.assert_error(409, "invalid_state");
    let refused = roost(&api, &["files", "ls", &sid]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not running"));
    stack.runner.assert_no_errors();
}

/// Audit finding (data path): a range of no byte (`length=0`: no server
/// asks one, a token captured on the server↔runner network could) made
/// the runner's `Content-Range` underflow. It is 416 at the runner, and a
/// real range still answers its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_no_byte_at_the_runner_is_unsatisfiable() {
    use sqlx::Connection;
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    sh(&api, &sid, "printf hello > /workspace/f").await;
    // The runner's own key, as the server keeps it.
    let db = stack.plane._tmp.path().join("data").join("roost.db");
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .expect("open the records");
    let (key,): (String,) = sqlx::query_as("SELECT data_key FROM runners WHERE id = $1")
        .bind(&stack.runner.runner_id)
        .fetch_one(&mut conn)
        .await
        .expect("the runner's data key");
    let key = api::data_path::parse_key(&key).expect("a key");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_millis() as u64;
    let token = api::data_path::mint(
        &key,
        &api::data_path::DataClaims {
            sandbox_id: sid.clone(),
            epoch: sandbox["epoch"].as_u64().expect("epoch"),
            op: api::files::ops::READ.to_owned(),
            command_id: None,
            subject: None,
            org_id: None,
            expires_unix_ms: now + 30_000,
        },
    );
    let runner = format!("{}/v1/data/sandboxes/{sid}/files", data_url(&stack.runner));
    let http = reqwest::Client::new();
    let read = |range: &'static str| {
        http.get(format!("{runner}?path=/workspace/f&{range}"))
            .bearer_auth(&token)
            .send()
    };
    let none = read("offset=1&length=0").await.expect("an answer");
    assert_eq!(none.status(), 416);
    let some = read("offset=1&length=3").await.expect("an answer");
    assert_eq!(some.status(), 206);
    assert_eq!(
        some.headers()["content-range"].to_str().expect("text"),
        "bytes 1-3/5"
    );
    assert_eq!(some.text().await.expect("body"), "ell");
    stack.runner.assert_no_errors();
}
