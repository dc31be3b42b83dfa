//! The OpenAPI document is one a generator can trust: every operation
//! states the tokens it takes (and the router agrees), every parameter and
//! field with a bound or a set of values states it, and a number written
//! `5.0` where the document says `integer` is accepted.

use serde_json::{Value, json};

use crate::support::TestServer;

async fn document(server: &TestServer) -> Value {
    reqwest::get(format!("{}/v1/openapi.json", server.url))
        .await
        .expect("fetch the document")
        .json()
        .await
        .expect("the document is JSON")
}

/// Every operation of the document: (method, path, operation).
fn operations(doc: &Value) -> Vec<(String, String, Value)> {
    let mut all = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("a path item") {
            all.push((method.clone(), path.clone(), operation.clone()));
        }
    }
    all
}

/// The schemes an operation's `security` names (alternatives).
fn schemes(operation: &Value) -> Vec<String> {
    let security = operation["security"]
        .as_array()
        .expect("every operation states its security");
    security
        .iter()
        .flat_map(|requirement| requirement.as_object().expect("a requirement").keys())
        .cloned()
        .collect()
}

async fn call(server: &TestServer, method: &str, path: &str, token: Option<&str>) -> (u16, Value) {
    let client = reqwest::Client::new();
    let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).expect("a method");
    let mut request = client
        .request(method, format!("{}{path}", server.url))
        .header("content-type", "application/json")
        .body("{}");
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_states_the_tokens_the_router_takes() {
    let server = TestServer::start().await;
    let doc = document(&server).await;
    let declared = doc["components"]["securitySchemes"]
        .as_object()
        .expect("security schemes");
    for name in [
        "admin_token",
        "org_token",
        "runner_token",
        "runner_credential",
    ] {
        assert_eq!(declared[name]["type"], "http", "{name}");
        assert_eq!(declared[name]["scheme"], "bearer", "{name}");
    }

    // One token of each kind.
    let org = server
        .admin
        .create_org(&api::orgs::CreateOrgRequest {
            name: "acme".to_owned(),
            max_running: None,
            max_total: None,
            max_store_mib: None,
        })
        .await
        .expect("an org");
    let runner_token = server
        .admin
        .create_runner_token(&Default::default())
        .await
        .expect("a runner token")
        .token;
    let credential = api::client::Client::new(&server.url, &runner_token)
        .runner_register(&crate::support::register_request("r1"))
        .await
        .expect("a runner registers")
        .runner_token
        .expect("a runner's credential");
    let admin_token = server.admin_token.clone();
    let tokens = [
        ("admin_token", admin_token.as_str()),
        ("org_token", org.token.as_str()),
        ("runner_token", runner_token.as_str()),
        ("runner_credential", credential.as_str()),
    ];

    for (method, path, operation) in operations(&doc) {
        let takes = schemes(&operation);
        // Path parameters filled in: the org's own id where an org is
        // named, a made-up id elsewhere (the answer may be 404 for the
        // resource, never "no such endpoint for this token").
        let concrete = path
            .replace("{org}", &org.org_id)
            .replace("{kind}", "blocks")
            .replace("{hex}", &"0".repeat(64))
            .replace("{action}", "drain")
            .replace("{stream}", "stdout")
            .replace("{name}", "nothing")
            .split('/')
            .map(|segment| {
                if segment.starts_with('{') {
                    "x_0"
                } else {
                    segment
                }
            })
            .collect::<Vec<_>>()
            .join("/");
        let (anonymous, _) = call(&server, &method, &concrete, None).await;
        if takes.is_empty() {
            assert_ne!(anonymous, 401, "{method} {path} takes no token");
            continue;
        }
        assert_eq!(anonymous, 401, "{method} {path} wants a token");
        for (kind, token) in tokens {
            let (status, body) = call(&server, &method, &concrete, Some(token)).await;
            let message = body["error"]["message"].as_str().unwrap_or_default();
            // The block service answers a token it does not take as it
            // answers an org the caller may not reach: "no such org".
            let refused_as_kind = status == 404
                && (message.starts_with("no such endpoint") || message == "no such org");
            if takes.iter().any(|t| t == kind) {
                assert!(
                    status != 401 && !message.starts_with("no such endpoint"),
                    "{method} {path} declares {kind} but the router refuses it: {status} {body}"
                );
            } else {
                assert!(
                    refused_as_kind,
                    "{method} {path} does not declare {kind} but the router takes it: {status} {body}"
                );
            }
        }
    }
}

/// The parameter `name` of an operation.
fn parameter<'a>(doc: &'a Value, method: &str, path: &str, name: &str) -> &'a Value {
    doc["paths"][path][method]["parameters"]
        .as_array()
        .and_then(|all| all.iter().find(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("{method} {path} has no parameter {name}"))
}

/// A component schema's property, following nothing (they are inline).
fn property<'a>(doc: &'a Value, schema: &str, field: &str) -> &'a Value {
    &doc["components"]["schemas"][schema]["properties"][field]
}

fn strings(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {value}"))
        .iter()
        .map(|v| v.as_str().expect("a string"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_and_fields_state_their_values_and_bounds() {
    let server = TestServer::start().await;
    let doc = document(&server).await;

    let wait_for = parameter(&doc, "get", "/v1/sandboxes/{id}", "wait_for");
    assert_eq!(
        wait_for["schema"]["$ref"], "#/components/schemas/SandboxState",
        "{wait_for}"
    );
    let timeout = parameter(&doc, "get", "/v1/sandboxes/{id}", "timeout");
    assert_eq!(timeout["schema"]["maximum"], 25, "{timeout}");
    // Bounds an audit found missing: a list's label filters, an output
    // offset the records can hold.
    let label = parameter(&doc, "get", "/v1/sandboxes", "label");
    assert_eq!(label["schema"]["maxItems"], 32, "{label}");
    assert_eq!(
        label["schema"]["items"]["pattern"],
        api::schema::LABEL_FILTER_PATTERN,
        "{label}"
    );
    for what in ["output", "attach"] {
        let path = format!("/v1/sandboxes/{{id}}/commands/{{command_id}}/{what}");
        let offset = parameter(&doc, "get", &path, "offset");
        assert_eq!(offset["schema"]["maximum"], i64::MAX, "{offset}");
    }
    let states = parameter(&doc, "get", "/v1/sandboxes", "state");
    assert_eq!(
        states["schema"]["items"]["$ref"], "#/components/schemas/SandboxState",
        "{states}"
    );
    for (path, cursor) in [
        ("/v1/sandboxes", "sbx"),
        ("/v1/sandboxes/{id}/commands", "cmd"),
        ("/v1/snapshots", "snp"),
    ] {
        let limit = parameter(&doc, "get", path, "limit");
        assert_eq!(limit["schema"]["minimum"], 1, "{path}: {limit}");
        assert_eq!(limit["schema"]["maximum"], 200, "{path}: {limit}");
        let pattern = &parameter(&doc, "get", path, "cursor")["schema"]["pattern"];
        assert!(
            pattern.as_str().unwrap_or_default().contains(cursor),
            "{path}: {pattern}"
        );
    }
    let command_wait = parameter(
        &doc,
        "get",
        "/v1/sandboxes/{id}/commands/{command_id}",
        "wait_for",
    );
    let values = strings(&command_wait["schema"]["enum"]);
    assert!(
        values.contains(&"ended") && values.contains(&"exited"),
        "{values:?}"
    );
    let stream = parameter(
        &doc,
        "get",
        "/v1/sandboxes/{id}/commands/{command_id}/output",
        "stream",
    );
    assert_eq!(strings(&stream["schema"]["enum"]), ["stdout", "stderr"]);
    let snapshot_wait = parameter(&doc, "get", "/v1/snapshots/{id}", "wait_for");
    assert_eq!(
        strings(&snapshot_wait["schema"]["enum"]),
        ["pending", "local", "replicated", "failed"]
    );
    for (method, path) in [
        ("post", "/v1/sandboxes"),
        ("post", "/v1/sandboxes/{id}/commands"),
        ("post", "/v1/sandboxes/{id}/snapshots"),
    ] {
        let key = &parameter(&doc, method, path, "Idempotency-Key")["schema"];
        assert_eq!(key["maxLength"], 255, "{path}: {key}");
        assert_eq!(key["minLength"], 1, "{path}: {key}");
        assert!(key["pattern"].is_string(), "{path}: {key}");
    }

    let signal = property(&doc, "SignalRequest", "signal");
    assert_eq!(strings(&signal["enum"]), api::commands::SIGNALS);
    let durability = property(&doc, "CreateSnapshotRequest", "durability");
    assert_eq!(strings(&durability["enum"]), ["local", "replicated"]);
    let ttl = property(&doc, "CreateSandboxRequest", "ttl");
    assert_eq!(ttl["minimum"], 1, "{ttl}");
    assert_eq!(ttl["maximum"], 365 * 24 * 3600, "{ttl}");
    let timeout = property(&doc, "CreateCommandRequest", "timeout");
    assert_eq!(timeout["minimum"], 1, "{timeout}");
    assert_eq!(timeout["maximum"], 30 * 24 * 3600, "{timeout}");
    let argv = property(&doc, "CreateCommandRequest", "argv");
    assert_eq!(argv["minItems"], 1, "{argv}");
    let image = property(&doc, "CreateSandboxRequest", "image");
    assert_eq!(image["pattern"], api::schema::NAME_PATTERN, "{image}");
    let env = property(&doc, "CreateSandboxRequest", "env");
    assert_eq!(env["maxProperties"], 128, "{env}");
    assert_eq!(
        env["propertyNames"]["pattern"],
        api::schema::ENV_NAME_PATTERN,
        "{env}"
    );
    let labels = property(&doc, "CreateSandboxRequest", "labels");
    assert_eq!(labels["maxProperties"], 32, "{labels}");
    for (field, schema) in [
        ("storage_class", "StorageClass"),
        ("network", "Network"),
        ("placement", "Placement"),
    ] {
        let value = property(&doc, "CreateSandboxRequest", field);
        assert!(
            value
                .to_string()
                .contains(&format!("#/components/schemas/{schema}")),
            "{field}: {value}"
        );
    }
    let memory = &doc["components"]["schemas"]["Resources"]["properties"]["memory_mib"];
    assert_eq!(memory["maximum"], 1u64 << 30, "{memory}");
    // The runtime's minimums, as admission enforces them.
    let resources = &doc["components"]["schemas"]["Resources"]["properties"];
    assert_eq!(
        resources["memory_mib"]["minimum"],
        api::sandboxes::MEMORY_MIB_MIN,
        "{resources}"
    );
    assert_eq!(
        resources["pids"]["minimum"],
        api::sandboxes::PIDS_MIN,
        "{resources}"
    );
    assert_eq!(
        resources["cpus"]["minimum"],
        api::sandboxes::CPUS_MIN,
        "{resources}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_integer_written_with_a_zero_fraction_is_accepted() {
    let server = TestServer::start().await;
    let create = |body: Value| {
        let url = format!("{}/v1/admin/orgs", server.url);
        let token = server.admin_token.clone();
        async move {
            let response = reqwest::Client::new()
                .post(url)
                .bearer_auth(token)
                .json(&body)
                .send()
                .await
                .expect("the server answers");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.expect("a JSON answer"),
            )
        }
    };
    let (status, body) =
        create(json!({"name": "whole", "max_running": 5.0, "max_total": 1e1})).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = create(json!({"name": "half", "max_running": 5.5})).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("max_running:"), "{message}");
    let (status, body) = create(json!({"name": "negative", "max_running": -1.0})).await;
    assert_eq!(status, 400, "{body}");
    // A wrong field is still named.
    let (status, body) = create(json!({"name": "unknown", "nonsense": 1})).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("nonsense"), "{message}");
}

/// The fuzzer, pinned so a run is replayable.
const SCHEMATHESIS: &str = "schemathesis==4.32.5";

/// A venv with the pinned fuzzer, made once under the target dir (from
/// PyPI, as `scripts/test.sh` installs moto). A marker written after the
/// install says it is complete: an interrupted one is made again.
fn fuzzer() -> std::path::PathBuf {
    let venv = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("schemathesis-4.32.5");
    let complete = venv.join("installed");
    if !complete.exists() {
        let run = |program: &std::path::Path, args: &[&str]| {
            let status = std::process::Command::new(program)
                .args(args)
                .status()
                .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
            assert!(status.success(), "{} {args:?}: {status}", program.display());
        };
        let _ = std::fs::remove_dir_all(&venv);
        let path = venv.to_str().expect("a UTF-8 path");
        run(std::path::Path::new("python3"), &["-m", "venv", path]);
        run(
            &venv.join("bin/pip"),
            &[
                "install",
                "--quiet",
                "--disable-pip-version-check",
                SCHEMATHESIS,
            ],
        );
        std::fs::write(&complete, SCHEMATHESIS).expect("mark the venv complete");
    }
    venv.join("bin/schemathesis")
}

/// Schemathesis against a live server, every operation with the token its
/// `security` names, for a bounded time with a fixed seed. It fails on a
/// 5xx (`not_a_server_error`), an answer the document does not describe
/// (`response_schema_conformance`) and a schema-valid request refused
/// with 400 or 422 (`positive_data_acceptance`; 404 for a made-up id, 409
/// and 429 are answers to valid requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_based_fuzzer_finds_nothing() {
    let fuzzer = tokio::task::spawn_blocking(fuzzer)
        .await
        .expect("install the fuzzer");
    let server = TestServer::start().await;
    let org = server.create_org("fuzzed").await;
    let runner_token = server
        .admin
        .create_runner_token(&Default::default())
        .await
        .expect("a runner token")
        .token;
    let mut register = crate::support::register_request("fuzz-runner");
    register.capabilities = [
        "image:default",
        "network:none",
        "network:bridge",
        "storage:standard",
        "storage:durable",
    ]
    .map(str::to_owned)
    .to_vec();
    let credential = api::client::Client::new(&server.url, &runner_token)
        .runner_register(&register)
        .await
        .expect("a runner registers")
        .runner_token
        .expect("a runner's credential");

    let dir = tempfile::tempdir().expect("a temp dir");
    let config = dir.path().join("schemathesis.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[auth.openapi.admin_token]
bearer = "{admin}"
[auth.openapi.org_token]
bearer = "{org}"
[auth.openapi.runner_token]
bearer = "{runner_token}"
[auth.openapi.runner_credential]
bearer = "{credential}"

[checks]
enabled = false
not_a_server_error.enabled = true
response_schema_conformance.enabled = true
positive_data_acceptance.enabled = true

# A sandbox's admission depends on more than its request: the images
# the org has, what the registered runners offer and hold, the
# deployment's save-interval bounds, and fields read together
# (`save_interval_s` only with `durable`; mounts whose paths overlap,
# filesystems bound to the org). A valid request may be
# refused (400/422) for those; the other checks still run.
[[operations]]
include-path = "/v1/sandboxes"
include-method = "POST"
checks.positive_data_acceptance.enabled = false

# An idle timeout is checked against the deployment's bounds
# (`--idle-timeout-min`, `--idle-timeout-max`), which a schema cannot
# state: a valid number may be refused (400 naming them).
[[operations]]
include-path = "/v1/sandboxes/{{id}}"
include-method = "PATCH"
checks.positive_data_acceptance.enabled = false

# An `offset` past the output written so far is refused (400 naming the
# length): how much output exists is the command's state, not the
# request's shape.
[[operations]]
include-path = "/v1/sandboxes/{{id}}/commands/{{command_id}}/output"
include-method = "GET"
checks.positive_data_acceptance.enabled = false
"#,
            admin = server.admin_token,
            org = org.token,
        ),
    )
    .expect("write the fuzzer's config");
    let url = format!("{}/v1/openapi.json", server.url);
    let report = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("openapi-fuzz.ndjson");
    // Fixed for replayable runs; `ROOST_FUZZ_SEED` explores further.
    let seed = std::env::var("ROOST_FUZZ_SEED").unwrap_or_else(|_| "20261201".to_owned());
    let mut command = std::process::Command::new(&fuzzer);
    command
        .current_dir(dir.path())
        .arg("--config-file")
        .arg(&config)
        .args(["run", &url])
        .args([
            // The checks are chosen in the config (where one operation can
            // leave one out).
            "--phases",
            "examples,coverage,fuzzing",
            "--seed",
            &seed,
            "--max-examples",
            "20",
            "--max-time",
            "75",
            // One worker: Python 3.11 before 3.11.8 (this machine's) can
            // fail `ast.parse` in two threads at once ("AST constructor
            // recursion depth mismatch", CPython gh-106905), which
            // Hypothesis calls while describing strategies: a crash of the
            // fuzzer itself, not a finding.
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--suppress-health-check",
            "all",
            "--no-color",
        ])
        // Every request and check, kept for a look after a failure.
        .args(["--report", "ndjson", "--report-ndjson-path"])
        .arg(&report);
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("the fuzzer's thread")
        .expect("run the fuzzer");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the fuzzer found something ({}):\n{stdout}\n{stderr}",
        output.status
    );
    // The checks ran (a config the fuzzer misread would pass with none).
    let events = std::fs::read_to_string(&report).expect("the fuzzer's report");
    for check in [
        "not_a_server_error",
        "response_schema_conformance",
        "positive_data_acceptance",
    ] {
        assert!(
            events.contains(&format!("\"{check}\"")),
            "{check} did not run (report: {})",
            report.display()
        );
    }
}

/// Issue 15, point 5: the file API is in the document with every
/// parameter (paths with their pattern, `Range`, `depth`'s bounds,
/// `mode`'s digits), every status it answers and its error code, and
/// `range_not_satisfiable` among the codes; only an org token reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_api_states_its_parameters_statuses_and_errors() {
    let server = TestServer::start().await;
    let doc = document(&server).await;
    let files = "/v1/sandboxes/{id}/files";
    let statuses = |method: &str, path: &str| -> Vec<String> {
        doc["paths"][path][method]["responses"]
            .as_object()
            .unwrap_or_else(|| panic!("{method} {path} has no responses"))
            .keys()
            .cloned()
            .collect()
    };
    for (method, path, expected) in [
        (
            "get",
            files.to_owned(),
            &["200", "206", "400", "404", "409", "416"][..],
        ),
        (
            "put",
            files.to_owned(),
            &["200", "201", "400", "404", "409", "507"],
        ),
        ("delete", files.to_owned(), &["200", "400", "404", "409"]),
        (
            "get",
            format!("{files}/list"),
            &["200", "400", "404", "409"],
        ),
        (
            "post",
            format!("{files}/move"),
            &["200", "400", "404", "409"],
        ),
        (
            "post",
            format!("{files}/mkdir"),
            &["200", "201", "400", "404", "409"],
        ),
        ("get", format!("{files}/tar"), &["200", "400", "404", "409"]),
        (
            "put",
            format!("{files}/tar"),
            &["200", "400", "404", "409", "507"],
        ),
    ] {
        let answered = statuses(method, &path);
        for status in expected {
            assert!(
                answered.iter().any(|s| s == status),
                "{method} {path} does not state {status}: {answered:?}"
            );
        }
        assert!(answered.iter().any(|s| s == "4XX"), "{method} {path}");
        let operation = &doc["paths"][path.as_str()][method];
        assert_eq!(schemes(operation), ["org_token"], "{method} {path}");
    }
    for (method, path) in [
        ("get", files.to_owned()),
        ("put", files.to_owned()),
        ("delete", files.to_owned()),
        ("get", format!("{files}/list")),
        ("get", format!("{files}/tar")),
        ("put", format!("{files}/tar")),
    ] {
        let given = parameter(&doc, method, &path, "path");
        assert_eq!(given["required"], true, "{method} {path}: {given}");
        assert_eq!(
            given["schema"]["pattern"],
            api::files::PATH_PATTERN,
            "{method} {path}: {given}"
        );
    }
    let range = parameter(&doc, "get", files, "Range");
    assert_eq!(range["in"], "header", "{range}");
    let depth = &parameter(&doc, "get", &format!("{files}/list"), "depth")["schema"];
    assert_eq!(depth["minimum"], 1, "{depth}");
    assert_eq!(depth["maximum"], api::files::LIST_DEPTH_MAX, "{depth}");
    let mode = &parameter(&doc, "put", files, "mode")["schema"];
    assert_eq!(mode["pattern"], api::files::MODE_PATTERN, "{mode}");
    for name in ["mode", "parents"] {
        parameter(&doc, "put", files, name);
    }
    parameter(&doc, "delete", files, "recursive");
    let headers = &doc["paths"][files]["get"]["responses"]["206"]["headers"];
    for name in [
        "Content-Range",
        "Content-Length",
        "Last-Modified",
        "x-roost-mode",
    ] {
        assert!(headers[name].is_object(), "206 states no {name}: {headers}");
    }
    let codes = strings(&doc["components"]["schemas"]["ErrorCode"]["enum"]);
    assert!(codes.contains(&"range_not_satisfiable"), "{codes:?}");
    assert!(codes.contains(&"insufficient_storage"), "{codes:?}");
    let entry = &doc["components"]["schemas"]["FileEntry"]["properties"];
    for field in ["path", "type", "size", "mode", "modified_at", "link_target"] {
        assert!(
            entry[field].is_object(),
            "FileEntry has no {field}: {entry}"
        );
    }
    let mkdir_mode = property(&doc, "MkdirRequest", "mode");
    assert!(
        mkdir_mode
            .to_string()
            .contains(api::files::MODE_PATTERN.replace('\\', "\\\\").as_str()),
        "{mkdir_mode}"
    );
}

/// A documented path with every method it does not document.
fn undocumented_methods(doc: &Value) -> Vec<(String, String)> {
    let mut all = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in ["get", "post", "put", "patch", "delete", "options"] {
            if item.get(method).is_none() {
                all.push((method.to_owned(), path.clone()));
            }
        }
    }
    all
}

/// Audit finding: a wrong method got axum's bare 405, an empty body, and
/// before authentication, so anyone could learn which admin paths exist.
/// Every method a documented path lacks answers the envelope: 405 for a
/// public path, and for an admin path 405 to the admin token only,
/// otherwise the unknown route's 404 (no `Allow` header either).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_method_a_documented_path_lacks_answers_the_envelope() {
    let server = TestServer::start().await;
    let doc = document(&server).await;
    let org = server.create_org("acme").await;
    let http = reqwest::Client::new();
    let unknown = http
        .post(format!("{}/v1/no-such-route", server.url))
        .send()
        .await
        .expect("the server answers")
        .json::<Value>()
        .await
        .expect("the envelope");
    let wrong = undocumented_methods(&doc);
    assert!(wrong.len() > 50, "{} cases", wrong.len());
    for (method, path) in wrong {
        let concrete = path
            .split('/')
            .map(|s| if s.starts_with('{') { "x_0" } else { s })
            .collect::<Vec<_>>()
            .join("/");
        let admin_path = path.starts_with("/v1/admin/");
        for (who, token) in [
            ("nobody", None),
            ("org", Some(org.token.as_str())),
            ("admin", Some(server.admin_token.as_str())),
        ] {
            let verb =
                reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).expect("a method");
            let mut request = http.request(verb, format!("{}{concrete}", server.url));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.expect("the server answers");
            let status = response.status().as_u16();
            let allow = response.headers().get("allow").cloned();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            let what = format!("{method} {path} as {who}: {status} {body}");
            assert!(
                body["error"]["request_id"]
                    .as_str()
                    .is_some_and(|id| !id.is_empty()),
                "the envelope: {what}"
            );
            if admin_path && who != "admin" {
                assert_eq!(status, 404, "{what}");
                assert_eq!(
                    body["error"]["message"], unknown["error"]["message"],
                    "as an unknown route: {what}"
                );
                assert!(allow.is_none(), "no Allow header: {what}");
            } else {
                assert_eq!(status, 405, "{what}");
                assert_eq!(body["error"]["code"], "invalid_request", "{what}");
                assert!(allow.is_some(), "an Allow header: {what}");
            }
        }
    }
}

/// Every route of the router (read from its source, `http::routes`) is in
/// the document with its methods, but the dashboard's files (`/ui`) and
/// E2B's API (`/e2b`, nested, with its own surface): a route added without
/// its `#[utoipa::path]` fails here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_of_the_router_is_in_the_document() {
    let server = TestServer::start().await;
    let doc = document(&server).await;
    let source = include_str!("../../src/http/mod.rs");
    let body = source.split_once("fn routes(").expect("http::routes").1;
    let body = body.split_once("\n}\n").expect("the end of router").0;
    let mut routes = 0;
    for call in body.split(".route(").skip(1) {
        // The call's text up to the next route (or the end of the chain).
        let call = call.split(".nest(").next().unwrap_or(call);
        let path = call
            .split('"')
            .nth(1)
            .expect("a route's path is its first literal");
        if path == "/ui" || path.starts_with("/ui/") {
            continue;
        }
        routes += 1;
        let methods: Vec<&str> = ["get", "post", "put", "patch", "delete"]
            .into_iter()
            .filter(|m| {
                call.contains(&format!("({m}("))
                    || call.contains(&format!(" {m}("))
                    || call.contains(&format!(".{m}("))
            })
            .collect();
        assert!(!methods.is_empty(), "{path}: no method read from {call:?}");
        for method in methods {
            assert!(
                doc["paths"][path].get(method).is_some(),
                "{method} {path} is routed but not in the OpenAPI document"
            );
        }
    }
    assert!(routes > 50, "{routes} routes read");
}
