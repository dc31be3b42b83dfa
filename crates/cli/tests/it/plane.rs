//! A control plane for tests: the real `roost server` process, HTTP
//! helpers, and `TestRunner`, which speaks the real runner protocol
//! (test code only: it reports what a test tells it to).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::BIN;

/// A running `roost server`; killed on drop.
pub struct Server {
    pub child: Child,
    pub url: String,
    pub admin_token: Option<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `roost server` on a free loopback port with `args` added and
/// `env` set; returns once it listens.
pub fn start_server_with(data_dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
    start_server_listening(data_dir, "127.0.0.1:0", args, env)
}

/// `start_server_with` on a given address, e.g. to restart a server where
/// its clients expect it.
pub fn start_server_listening(
    data_dir: &Path,
    listen: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Server {
    spawn_server(data_dir, listen, args, env, Stdio::inherit())
}

/// `start_server_with`, its log lines (stderr) written to `log`.
pub fn start_server_logging(
    data_dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    log: std::fs::File,
) -> Server {
    spawn_server(data_dir, "127.0.0.1:0", args, env, Stdio::from(log))
}

fn spawn_server(
    data_dir: &Path,
    listen: &str,
    args: &[&str],
    env: &[(&str, &str)],
    stderr: Stdio,
) -> Server {
    let mut command = Command::new(BIN);
    command.args([
        "server",
        "--listen",
        listen,
        "--data-dir",
        data_dir.to_str().expect("utf8"),
    ]);
    command.args(args);
    if !args.contains(&"--metrics-token-file") {
        command
            .arg("--metrics-token-file")
            .arg(metrics_token_file());
    }
    // Quiet unless a test asks: the server's stderr goes to the test output.
    command.env("ROOST_LOG", "warn");
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("start server");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("a line").expect("read");
    let url = first
        .strip_prefix("roost server listening on ")
        .expect("listening line")
        .to_owned();
    // The second line says whether this start created the admin token.
    let second = lines.next().expect("a second line").expect("read");
    let admin_token = second
        .starts_with("admin token (shown once")
        .then(|| second.rsplit(' ').next().map(str::to_owned))
        .flatten();
    Server {
        child,
        url,
        admin_token,
    }
}

pub fn start_server(data_dir: &Path, database: Option<&str>) -> Server {
    match database {
        Some(database) => start_server_with(data_dir, &["--database", database], &[]),
        None => start_server_with(data_dir, &[], &[]),
    }
}

/// A fresh PostgreSQL database on the server `scripts/test.sh` starts.
pub fn postgres_database(name: &str) -> String {
    let base = std::env::var("ROOST_TEST_POSTGRES_URL").expect(
        "PostgreSQL tests need the server scripts/test.sh starts (ROOST_TEST_POSTGRES_URL unset)",
    );
    let name = format!("roost_test_{name}_{}", std::process::id());
    // Its own thread: callers may be inside an async runtime already.
    let create = name.clone();
    let base_url = base.clone();
    std::thread::spawn(move || create_database(&base_url, &create))
        .join()
        .expect("create database");
    let (prefix, _) = base.rsplit_once('/').expect("url with a database");
    format!("{prefix}/{name}")
}

fn create_database(base: &str, name: &str) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(base)
            .await
            .expect("connect to postgres");
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
            .execute(&mut conn)
            .await
            .expect("drop");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .expect("create");
    });
}

/// An HTTP answer: status, headers we look at, JSON body (or Null).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
    pub request_id: Option<String>,
    pub retry_after: Option<String>,
    pub replayed: bool,
    pub headers: reqwest::header::HeaderMap,
    pub bytes: Vec<u8>,
}

impl Answer {
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }

    /// Asserts the error envelope with `code`, a message and the request id.
    pub fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.code(), code, "{self:?}");
        assert!(
            !self.body["error"]["message"]
                .as_str()
                .unwrap_or("")
                .is_empty(),
            "{self:?}"
        );
        assert_eq!(
            self.body["error"]["request_id"].as_str(),
            self.request_id.as_deref(),
            "{self:?}"
        );
    }

    pub fn str(&self, field: &str) -> String {
        self.body[field]
            .as_str()
            .unwrap_or_else(|| panic!("{field} in {}", self.body))
            .to_owned()
    }
}

/// A client for one token.
#[derive(Clone)]
pub struct Api {
    pub url: String,
    pub token: String,
    http: reqwest::Client,
}

impl Api {
    pub fn new(url: &str, token: &str) -> Api {
        Api {
            url: url.to_owned(),
            token: token.to_owned(),
            // No pooled connections: a server closing one after an early
            // 413 must not fail the next request that reuses it.
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .timeout(Duration::from_secs(60))
                .build()
                .expect("client"),
        }
    }

    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
        headers: &[(&str, &str)],
    ) -> Result<Answer, reqwest::Error> {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body);
        }
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let request_id = header("x-request-id");
        let retry_after = header("retry-after");
        let replayed = header("idempotent-replayed").is_some();
        let bytes = response.bytes().await?.to_vec();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok(Answer {
            status,
            body,
            request_id,
            retry_after,
            replayed,
            headers,
            bytes,
        })
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.send(reqwest::Method::GET, path, None, &[])
            .await
            .expect("GET")
    }

    pub async fn delete(&self, path: &str) -> Answer {
        self.send(reqwest::Method::DELETE, path, None, &[])
            .await
            .expect("DELETE")
    }

    pub async fn post(&self, path: &str, body: Value) -> Answer {
        self.post_with(path, body, &[]).await
    }

    pub async fn post_with(&self, path: &str, body: Value, headers: &[(&str, &str)]) -> Answer {
        self.send(
            reqwest::Method::POST,
            path,
            Some(body.to_string().into_bytes()),
            headers,
        )
        .await
        .expect("POST")
    }

    pub async fn post_raw(&self, path: &str, body: &str) -> Answer {
        self.send(
            reqwest::Method::POST,
            path,
            Some(body.as_bytes().to_vec()),
            &[],
        )
        .await
        .expect("POST")
    }
}

/// A control plane with an org and a runner token, on SQLite or PG.
pub struct Plane {
    pub server: Server,
    pub admin: Api,
    pub admin_token: String,
    pub org: Api,
    pub org_id: String,
    pub runner_token: String,
    pub _tmp: tempfile::TempDir,
}

impl Plane {
    pub async fn start(args: &[&str]) -> Plane {
        Plane::start_with(args, &[], None).await
    }

    pub async fn start_with(args: &[&str], env: &[(&str, &str)], database: Option<&str>) -> Plane {
        let mut all: Vec<&str> = args.to_vec();
        if let Some(database) = database {
            all.extend(["--database", database]);
        }
        Plane::start_listening("127.0.0.1:0", &all, env).await
    }

    /// A plane whose server listens on `listen` (e.g. `0.0.0.0:0`, for
    /// runners in other network namespaces).
    pub async fn start_listening(listen: &str, args: &[&str], env: &[(&str, &str)]) -> Plane {
        let tmp = tempfile::tempdir().expect("tempdir");
        let server = start_server_listening(&tmp.path().join("data"), listen, args, env);
        let admin_token = server.admin_token.clone().expect("admin token");
        let admin = Api::new(&server.url, &admin_token);
        let (org, org_id) = new_org(&admin, "acme", json!({})).await;
        let runner_token = admin
            .post("/v1/admin/runner-tokens", json!({}))
            .await
            .str("token");
        Plane {
            org,
            org_id,
            admin,
            admin_token,
            runner_token,
            server,
            _tmp: tmp,
        }
    }

    /// Kills the server (as a crash would) and, after `down`, starts it
    /// again on the same address and data dir with `args`.
    pub async fn restart_server(&mut self, down: Duration, args: &[&str]) {
        let _ = self.server.child.kill();
        let _ = self.server.child.wait();
        tokio::time::sleep(down).await;
        let listen = self
            .server
            .url
            .strip_prefix("http://")
            .expect("http url")
            .to_owned();
        self.server = start_server_listening(&self._tmp.path().join("data"), &listen, args, &[]);
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.server
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("a port in the server url")
    }

    pub async fn runner(&self, name: &str, class: &str, capabilities: &[&str]) -> TestRunner {
        TestRunner::register(
            &self.server.url,
            &self.runner_token,
            name,
            class,
            capabilities,
            4,
        )
        .await
    }

    /// A sandbox created and reported running by `runner`.
    pub async fn running_sandbox(&self, runner: &TestRunner, body: Value) -> Value {
        let created = self.org.post("/v1/sandboxes", body).await;
        assert_eq!(created.status, 201, "{created:?}");
        assert_eq!(created.body["runner_id"], runner.id.as_str(), "{created:?}");
        let id = created.str("id");
        runner.report(&id, "running", None).await;
        self.org.get(&format!("/v1/sandboxes/{id}")).await.body
    }
}

/// Creates an org with `limits` merged into the request.
pub async fn new_org(admin: &Api, name: &str, limits: Value) -> (Api, String) {
    let mut request = json!({ "name": name });
    if let (Some(request), Some(limits)) = (request.as_object_mut(), limits.as_object()) {
        request.extend(limits.clone());
    }
    let org = admin.post("/v1/admin/orgs", request).await;
    assert_eq!(org.status, 201, "{org:?}");
    (Api::new(&admin.url, &org.str("token")), org.str("org_id"))
}

pub const STANDARD: &[&str] = &["image:default", "network:none", "storage:standard"];
pub const ALL: &[&str] = &[
    "image:default",
    "network:none",
    "network:bridge",
    "storage:standard",
    "storage:durable",
];

/// Speaks the runner protocol for a test.
pub struct TestRunner {
    pub api: Api,
    pub id: String,
}

impl TestRunner {
    pub async fn register(
        url: &str,
        token: &str,
        name: &str,
        class: &str,
        capabilities: &[&str],
        sandboxes: u64,
    ) -> TestRunner {
        let api = Api::new(url, token);
        let registered = api
            .post(
                "/v1/runner/register",
                json!({
                    "name": name,
                    "placement_class": class,
                    "capabilities": capabilities,
                    "capacity": {"sandboxes": sandboxes, "memory_mib": 65536, "cpus": 64, "pids": 1_000_000},
                }),
            )
            .await;
        assert_eq!(registered.status, 200, "{registered:?}");
        let id = registered.str("runner_id");
        // Every later call goes with the runner's own credential: the
        // runner token only registers.
        let api = Api::new(url, &registered.str("runner_token"));
        TestRunner { api, id }
    }

    pub async fn heartbeat(&self) -> Answer {
        self.api
            .post("/v1/runner/heartbeat", json!({ "runner_id": self.id }))
            .await
    }

    pub async fn assignments(&self) -> Value {
        let answer = self
            .api
            .get(&format!("/v1/runner/assignments?runner_id={}", self.id))
            .await;
        assert_eq!(answer.status, 200, "{answer:?}");
        answer.body
    }

    /// The sandbox's assignment as this runner sees it.
    pub async fn assignment(&self, sandbox_id: &str) -> Value {
        let all = self.assignments().await;
        all["sandboxes"]
            .as_array()
            .expect("sandboxes")
            .iter()
            .find(|s| s["sandbox_id"] == sandbox_id)
            .cloned()
            .unwrap_or(Value::Null)
    }

    /// Reports `state` at the sandbox's current epoch (read from the
    /// assignments); must be accepted.
    pub async fn report(&self, sandbox_id: &str, state: &str, reason: Option<&str>) -> Value {
        let epoch = self.assignment(sandbox_id).await["epoch"]
            .as_u64()
            .expect("assigned");
        let answer = self.report_at(sandbox_id, epoch, state, reason).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        answer.body
    }

    pub async fn report_at(
        &self,
        sandbox_id: &str,
        epoch: u64,
        state: &str,
        reason: Option<&str>,
    ) -> Answer {
        self.api
            .post(
                &format!("/v1/runner/sandboxes/{sandbox_id}/report"),
                json!({ "runner_id": self.id, "epoch": epoch, "state": state, "reason": reason }),
            )
            .await
    }

    pub async fn report_command(&self, command_id: &str, epoch: u64, body: Value) -> Answer {
        let mut body = body;
        body["runner_id"] = json!(self.id);
        body["epoch"] = json!(epoch);
        self.api
            .post(&format!("/v1/runner/commands/{command_id}/report"), body)
            .await
    }

    pub async fn append_output(
        &self,
        command_id: &str,
        epoch: u64,
        stream: &str,
        offset: u64,
        data: &[u8],
    ) -> Answer {
        self.api
            .send(
                reqwest::Method::PUT,
                &format!(
                    "/v1/runner/commands/{command_id}/output/{stream}?runner_id={}&epoch={epoch}&offset={offset}",
                    self.id
                ),
                Some(data.to_vec()),
                &[],
            )
            .await
            .expect("PUT output")
    }
}

/// Polls `check` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The metrics token every test server is started with
/// (`--metrics-token-file`), unless a test gives its own.
pub const METRICS_TOKEN: &str = "roost-test-metrics-token-0123456789abcdef";

/// A file holding [`METRICS_TOKEN`], written once per test process.
pub fn metrics_token_file() -> &'static Path {
    static FILE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let path =
            std::env::temp_dir().join(format!("roost-test-metrics-token-{}", std::process::id()));
        std::fs::write(&path, format!("{METRICS_TOKEN}\n")).expect("write the metrics token");
        path
    })
}

/// The server's `/metrics` text, read with the metrics token (the server
/// `api` talks to, whatever its token).
pub async fn metrics_text(api: &Api) -> String {
    let metrics = Api::new(&api.url, METRICS_TOKEN).get("/metrics").await;
    assert_eq!(metrics.status, 200, "{metrics:?}");
    String::from_utf8_lossy(&metrics.bytes).into_owned()
}

/// A counter from the server's `/metrics`: the sum of the samples whose
/// line starts with `prefix` (a metric name and the start of its labels).
pub async fn metric(api: &Api, prefix: &str) -> u64 {
    metrics_text(api)
        .await
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Objects the block service has handed out (runners' downloads), one by
/// one or in fetch batches.
pub async fn block_downloads(api: &Api) -> u64 {
    metric(api, "roost_block_objects_total{direction=\"out\"}").await
}

/// Requests that downloaded objects from the block service.
pub async fn block_download_requests(api: &Api) -> u64 {
    metric(
        api,
        "roost_http_requests_total{method=\"GET\",route=\"/v1/blocks/{org}/{kind}/{hex}\",status=\"200\"",
    )
    .await
        + metric(
            api,
            "roost_http_requests_total{method=\"POST\",route=\"/v1/blocks/{org}/fetch\",status=\"200\"",
        )
        .await
}
