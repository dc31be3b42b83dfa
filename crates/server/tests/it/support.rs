//! A server in this process for a test: its own temp data dir (SQLite,
//! the admin token) and local content store, on a loopback port; stopped
//! when dropped.

use std::net::SocketAddr;

use api::client::Client;
use api::orgs::{CreateOrgRequest, CreateOrgResponse};
use api::runners::{Capacity, RegisterRequest};
use store::OrgId;

pub struct TestServer {
    pub url: String,
    pub admin: Client,
    pub admin_token: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    /// Kept for the server's lifetime.
    _data: tempfile::TempDir,
}

impl TestServer {
    /// Starts a server with a content store and waits until it listens.
    pub async fn start() -> TestServer {
        Self::start_with_store(None).await
    }

    /// As [`TestServer::start`], with the content store at `store` (a
    /// directory the test prepared) instead of one in the data dir.
    pub async fn start_with_store(store: Option<&std::path::Path>) -> TestServer {
        Self::start_configured(store, |_| {}).await
    }

    /// As [`TestServer::start_with_store`], with `configure` changing the
    /// configuration last (a failpoint, say).
    pub async fn start_configured(
        store: Option<&std::path::Path>,
        configure: impl FnOnce(&mut server::Config),
    ) -> TestServer {
        let data = tempfile::Builder::new()
            .prefix("roost-server-it-")
            .tempdir()
            .expect("a temp data dir");
        let listen: SocketAddr = "127.0.0.1:0".parse().expect("a loopback address");
        let mut config = server::Config::new(listen, data.path().join("server"));
        // As `roost server` does by default: a key file in the data dir.
        config.secret_key = server::control::secrets::SecretKeySource::File(
            data.path().join("server").join("secret-key"),
        );
        let store = store.map_or_else(|| data.path().join("store"), std::path::Path::to_path_buf);
        config.store_url = Some(store.display().to_string());
        configure(&mut config);
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let stopped = async {
                let _ = stop.await;
            };
            let served = server::serve(config, stopped, |started| {
                let _ = started_tx.send(started);
            })
            .await;
            if let Err(err) = served {
                panic!("the test server failed: {err}");
            }
        });
        let started = started_rx.await.expect("the server starts");
        let token = started
            .admin_token
            .expect("a fresh data dir makes an admin token");
        TestServer {
            admin: Client::new(&started.url, &token),
            admin_token: token,
            url: started.url,
            shutdown: Some(shutdown),
            _data: data,
        }
    }

    /// A new org without quotas, as the admin's answer gives it.
    pub async fn create_org(&self, name: &str) -> CreateOrgResponse {
        self.admin
            .create_org(&CreateOrgRequest {
                name: name.to_owned(),
                max_running: None,
                max_total: None,
                max_store_mib: None,
            })
            .await
            .expect("create an org")
    }

    /// A new org: a client with its token, and its id as the store names it.
    pub async fn org(&self, name: &str) -> (Client, OrgId) {
        let created = self.create_org(name).await;
        let org = created.org_id.parse().expect("an org id is a store org");
        (Client::new(&self.url, &created.token), org)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// A runner's registration offering the default image, standard storage
/// and room for 8 sandboxes.
pub fn register_request(name: &str) -> RegisterRequest {
    RegisterRequest {
        runner_id: None,
        name: name.to_owned(),
        placement_class: "on_demand".to_owned(),
        labels: Default::default(),
        capabilities: ["image:default", "network:none", "storage:standard"]
            .map(str::to_owned)
            .to_vec(),
        capacity: Capacity {
            sandboxes: 8,
            memory_mib: 64 * 1024,
            cpus: 64.0,
            pids: 1 << 20,
        },
        data_url: None,
        data_key: None,
    }
}

/// An org's sandbox reported running by a runner registered for it (with
/// its data listener at `data_url`, if any): the org's and the runner's
/// clients, the org's token, the ids.
pub struct RunningSandbox {
    pub org: Client,
    pub org_token: String,
    pub sandbox_id: String,
    pub runner: Client,
    pub runner_id: String,
}

pub async fn running_sandbox(server: &TestServer, data_url: Option<&str>) -> RunningSandbox {
    let enrolment = server
        .admin
        .create_runner_token(&Default::default())
        .await
        .expect("a runner token")
        .token;
    let mut request = register_request("r1");
    if let Some(url) = data_url {
        request.data_url = Some(url.to_owned());
        request.data_key = Some("ab".repeat(32));
    }
    let registered = Client::new(&server.url, &enrolment)
        .runner_register(&request)
        .await
        .expect("a runner registers");
    let runner = Client::new(
        &server.url,
        &registered.runner_token.expect("a runner's credential"),
    );
    let created = server.create_org("acme").await;
    let org = Client::new(&server.url, &created.token);
    let sandbox = org
        .create_sandbox(
            &serde_json::from_value(serde_json::json!({ "image": "default" }))
                .expect("a create request"),
            None,
        )
        .await
        .expect("a sandbox");
    let assigned = runner
        .runner_assignments(&registered.runner_id, "", 0)
        .await
        .expect("the runner's assignments");
    let running = api::runners::SandboxReport {
        runner_id: registered.runner_id.clone(),
        epoch: assigned.sandboxes[0].epoch,
        state: api::lifecycle::SandboxState::Running,
        reason: None,
        message: None,
        wake: None,
    };
    runner
        .runner_report_sandbox(&sandbox.id, &running)
        .await
        .expect("the sandbox runs");
    RunningSandbox {
        org,
        org_token: created.token,
        sandbox_id: sandbox.id,
        runner,
        runner_id: registered.runner_id,
    }
}
