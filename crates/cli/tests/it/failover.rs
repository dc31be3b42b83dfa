//! Host failure end to end (DESIGN.md §7): several `roost runner`
//! processes on this machine act as separate hosts, each with its own data
//! dir and its own network namespace joined to the server by a veth pair,
//! so a test can cut a host off (`ip link set … down`) as a partition
//! would, kill it, or restart the server under it. Everything asserted
//! was observed: container states through runc, homes through the
//! sandboxes, records through the API.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::durable::LISTING;
use crate::harness::BIN;
use crate::plane::{Api, Plane, eventually, metric};
use crate::runner_e2e::{
    RunnerProcess, create_running, force_delete_containers, sh, unmount_homes, wait_command,
};

fn run(program: &str, args: &[&str]) {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{program} {args:?}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("time")
        .as_millis() as i64
}

pub(crate) fn parse_ms(rfc3339: &str) -> i64 {
    humantime::parse_rfc3339(rfc3339)
        .unwrap_or_else(|e| panic!("{rfc3339:?}: {e}"))
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// A host's network: a namespace with one veth pair to the test's (the
/// server's) namespace. Cutting it takes the link down, as a partition
/// would: packets vanish, nothing is refused.
struct Link {
    netns: String,
    host_if: String,
    /// The server as seen from inside the namespace.
    host_ip: String,
}

impl Link {
    fn new() -> Link {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = std::process::id() % 10_000;
        let netns = format!("roost-f{tag}-{n}");
        let host_if = format!("rf{tag}h{n}");
        let ns_if = format!("rf{tag}n{n}");
        let subnet = format!("10.231.{n}");
        let host_ip = format!("{subnet}.1");
        let _ = Command::new("ip")
            .args(["netns", "del", &netns])
            .stderr(Stdio::null())
            .status();
        run("ip", &["netns", "add", &netns]);
        run(
            "ip",
            &[
                "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
            ],
        );
        run("ip", &["link", "set", &ns_if, "netns", &netns]);
        run(
            "ip",
            &["addr", "add", &format!("{host_ip}/30"), "dev", &host_if],
        );
        run("ip", &["link", "set", &host_if, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", netns.as_str(), "ip"];
            all.extend_from_slice(args);
            run("ip", &all);
        };
        inside(&["addr", "add", &format!("{subnet}.2/30"), "dev", &ns_if]);
        inside(&["link", "set", &ns_if, "up"]);
        inside(&["link", "set", "lo", "up"]);
        Link {
            netns,
            host_if,
            host_ip,
        }
    }

    fn cut(&self) {
        run("ip", &["link", "set", &self.host_if, "down"]);
    }

    fn heal(&self) {
        run("ip", &["link", "set", &self.host_if, "up"]);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Deleting the namespace deletes the veth pair with it.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .stderr(Stdio::null())
            .status();
    }
}

/// One host: a runner in its own namespace. The runner goes first.
struct Host {
    runner: RunnerProcess,
    link: Link,
    /// The runner's `--cgroup-parent`, removed with the host.
    cgroup: String,
}

impl Drop for Host {
    fn drop(&mut self) {
        self.runner.kill9();
        force_delete_containers(&self.runner.runtime_root());
        remove_cgroups(&self.cgroup);
    }
}

/// A runner's parent cgroups outlive its containers; empty, they can go.
pub(crate) fn remove_cgroups(name: &str) {
    if let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") {
        for controller in controllers.flatten() {
            let _ = std::fs::remove_dir(controller.path().join(name));
        }
    }
    let _ = std::fs::remove_dir(PathBuf::from("/sys/fs/cgroup").join(name));
}

/// A server with a store, listening on every address, and hosts.
struct Cluster {
    hosts: Vec<Host>,
    plane: Plane,
    server_args: Vec<String>,
    _store: tempfile::TempDir,
    dir: tempfile::TempDir,
}

impl Cluster {
    async fn start(extra: &[&str]) -> Cluster {
        let store = tempfile::tempdir().expect("store dir");
        let mut server_args: Vec<String> = vec![
            "--store".to_owned(),
            store.path().to_str().expect("utf-8").to_owned(),
            "--save-interval-min".to_owned(),
            "1s".to_owned(),
        ];
        server_args.extend(extra.iter().map(|a| (*a).to_owned()));
        let args: Vec<&str> = server_args.iter().map(String::as_str).collect();
        let plane = Plane::start_listening("0.0.0.0:0", &args, &[]).await;
        let dir = tempfile::Builder::new()
            .prefix("roost-failover-")
            .tempdir()
            .expect("tempdir");
        Cluster {
            hosts: Vec::new(),
            plane,
            server_args,
            _store: store,
            dir,
        }
    }

    fn api(&self) -> &Api {
        &self.plane.org
    }

    fn data_dir(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Starts host `name` (`spot` or `on_demand`); returns its index.
    fn host(&mut self, name: &str, class: &str) -> usize {
        let link = Link::new();
        let url = format!("http://{}:{}", link.host_ip, self.plane.port());
        // Hosts share this machine's cgroup tree: a sandbox recovered on
        // one while the other still holds it frozen needs its own cgroup.
        let cgroup = format!("{}-{name}", link.netns);
        let runner = RunnerProcess::start_in(
            &url,
            &self.plane.runner_token,
            &self.data_dir(name),
            &[],
            Some(&link.netns),
            &[
                "--placement-class",
                class,
                "--name",
                name,
                "--cgroup-parent",
                &cgroup,
            ],
        );
        self.hosts.push(Host {
            runner,
            link,
            cgroup,
        });
        self.hosts.len() - 1
    }

    fn runner_id(&self, host: usize) -> String {
        self.hosts[host].runner.runner_id.clone()
    }

    /// kill -9 the runner and delete its data dir: the host is gone.
    fn destroy(&mut self, host: usize) {
        let runner = &mut self.hosts[host].runner;
        runner.kill9();
        force_delete_containers(&runner.runtime_root());
        let data = runner.data_dir.clone();
        unmount_homes(&data);
        std::fs::remove_dir_all(&data).expect("delete the runner's data dir");
    }

    async fn restart_server(&mut self, down: Duration) {
        let args: Vec<&str> = self.server_args.iter().map(String::as_str).collect();
        self.plane.restart_server(down, &args).await;
    }

    async fn create(&self, body: Value) -> String {
        create_running(self.api(), body).await
    }

    async fn get(&self, id: &str) -> Value {
        self.api().get(&format!("/v1/sandboxes/{id}")).await.body
    }

    async fn events(&self, id: &str) -> Vec<Value> {
        let events = self.api().get(&format!("/v1/sandboxes/{id}/events")).await;
        assert_eq!(events.status, 200, "{events:?}");
        events.body["events"].as_array().expect("events").clone()
    }

    /// The sandbox's history has a `state` event with `reason`.
    async fn assert_event(&self, id: &str, state: &str, reason: &str) {
        let events = self.events(id).await;
        assert!(
            events
                .iter()
                .any(|e| e["state"] == state && e["reason"] == reason),
            "no {state} ({reason}) event: {events:#?}"
        );
    }

    /// The runner's record as the control plane sees it.
    async fn runner_record(&self, host: usize) -> Value {
        let id = self.runner_id(host);
        let runners = self.plane.admin.get("/v1/admin/runners").await;
        assert_eq!(runners.status, 200, "{runners:?}");
        runners
            .body
            .as_array()
            .expect("runners")
            .iter()
            .find(|r| r["id"] == id.as_str())
            .cloned()
            .unwrap_or_else(|| panic!("runner {id} not listed: {}", runners.body))
    }

    /// Waits until the sandbox runs on `host`.
    async fn wait_running_on(&self, id: &str, host: usize, within: Duration) -> Value {
        let runner = self.runner_id(host);
        let api = self.api();
        let ok = eventually(within, || async {
            let sandbox = api.get(&format!("/v1/sandboxes/{id}")).await.body;
            sandbox["state"] == "running" && sandbox["runner_id"] == runner.as_str()
        })
        .await;
        let sandbox = self.get(id).await;
        assert!(ok, "{id} is not running on {runner}: {sandbox}");
        sandbox
    }

    /// Waits until the home as of now is in a completed save: `safe_until`
    /// (a completed save's capture, or a later save's finding that nothing
    /// changed since) is after now.
    async fn wait_saved(&self, id: &str) -> Value {
        let since = now_ms();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let sandbox = self.get(id).await;
            if let Some(saved) = sandbox["save"]["safe_until"].as_str()
                && parse_ms(saved) > since
            {
                return sandbox;
            }
            assert!(Instant::now() < deadline, "no save completed: {sandbox}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn admin_cli(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .arg("admin")
            .args(args)
            .env("ROOST_URL", &self.plane.server.url)
            .env("ROOST_TOKEN", &self.plane.admin_token)
            .output()
            .expect("run roost admin")
    }
}

/// Starts a command and waits until it runs; returns its id.
async fn start_command(api: &Api, sandbox: &str, argv: &[&str]) -> String {
    let created = api
        .post(
            &format!("/v1/sandboxes/{sandbox}/commands"),
            json!({ "argv": argv }),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let id = created.str("id");
    let command = wait_command(api, sandbox, &id, "running").await;
    assert_eq!(command["state"], "running", "{command}");
    id
}

async fn command(api: &Api, sandbox: &str, id: &str) -> Value {
    api.get(&format!("/v1/sandboxes/{sandbox}/commands/{id}"))
        .await
        .body
}

/// Appends the time (ms) to /workspace/ticks twenty times a second, for
/// as long as it runs.
const TICKER: &[&str] = &[
    "sh",
    "-c",
    "while :; do date +%s%3N >> /workspace/ticks; sleep 0.05; done",
];

/// The newest tick in a ticks file's text.
fn last_tick(ticks: &str) -> i64 {
    ticks
        .lines()
        .filter_map(|l| l.trim().parse::<i64>().ok())
        .max()
        .unwrap_or(0)
}

/// The first event in `state` (after `from`, by seq).
fn event<'a>(events: &'a [Value], state: &str, from: u64) -> &'a Value {
    events
        .iter()
        .find(|e| e["state"] == state && e["seq"].as_u64() > Some(from))
        .unwrap_or_else(|| panic!("no {state} event after #{from}: {events:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destroyed_host_brings_its_durable_sandbox_back_elsewhere_and_says_what_became_of_commands()
 {
    let mut cluster = Cluster::start(&["--lease-ttl", "3s"]).await;
    let first = cluster.host("a", "on_demand");
    let durable = cluster
        .create(json!({"storage_class": "durable", "save_interval_s": 1}))
        .await;
    let standard = cluster.create(json!({})).await;
    let api = cluster.api();
    for id in [&durable, &standard] {
        assert_eq!(
            cluster.get(id).await["runner_id"],
            cluster.runner_id(first).as_str()
        );
    }
    // A finished task's files, then a completed save that holds them.
    sh(
        api,
        &durable,
        "mkdir -p /workspace/task && head -c 200000 /dev/urandom > /workspace/task/data \
         && printf 'done\\n' > /workspace/task/result && chmod 0640 /workspace/task/result \
         && ln -s task/result /workspace/latest",
    )
    .await;
    let before = sh(api, &durable, LISTING).await;
    cluster.wait_saved(&durable).await;
    let on_standard = start_command(api, &standard, &["sleep", "600"]).await;
    let on_durable = start_command(api, &durable, &["sleep", "600"]).await;

    // The runner is stopped while its long-poll is out: the server hands it
    // the next command (`starting`), and it never says whether it ran.
    // (Stopped until the server holds a long-poll of it: one answered just
    // before the stop, say for a save, would never be followed by another.)
    let mut polling = false;
    for _ in 0..10 {
        cluster.hosts[first]
            .runner
            .signal(rustix::process::Signal::STOP);
        tokio::time::sleep(Duration::from_millis(200)).await;
        if metric(&cluster.plane.admin, "roost_long_poll_waiters").await > 0 {
            polling = true;
            break;
        }
        cluster.hosts[first]
            .runner
            .signal(rustix::process::Signal::CONT);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(polling, "the runner never had a long-poll out");
    let handed = api
        .post(
            &format!("/v1/sandboxes/{durable}/commands"),
            json!({"argv": ["touch", "/workspace/handed"]}),
        )
        .await
        .str("id");
    assert!(
        eventually(Duration::from_secs(5), || async {
            command(api, &durable, &handed).await["state"] == "starting"
        })
        .await,
        "the command was not handed over: {}",
        command(api, &durable, &handed).await
    );
    // Nobody asks for this one: it stays queued.
    let queued = api
        .post(
            &format!("/v1/sandboxes/{durable}/commands"),
            json!({"argv": ["touch", "/workspace/queued"]}),
        )
        .await
        .str("id");
    assert_eq!(command(api, &durable, &queued).await["state"], "queued");

    let lost_at = now_ms();
    cluster.destroy(first);
    let second = cluster.host("b", "on_demand");
    let recovered = cluster
        .wait_running_on(&durable, second, Duration::from_secs(30))
        .await;
    let api = cluster.api();
    assert!(recovered["epoch"].as_u64() > Some(1), "{recovered}");
    assert_eq!(
        sh(api, &durable, LISTING).await,
        before,
        "the home came back different"
    );

    let standard_record = cluster.get(&standard).await;
    assert_eq!(standard_record["state"], "failed", "{standard_record}");
    assert_eq!(
        standard_record["state_reason"], "node_lost",
        "{standard_record}"
    );
    let ended = |record: Value, state: &str| {
        assert_eq!(record["state"], state, "{record}");
    };
    ended(
        command(api, &standard, &on_standard).await,
        "infrastructure_lost",
    );
    ended(
        command(api, &durable, &on_durable).await,
        "infrastructure_lost",
    );
    ended(command(api, &durable, &handed).await, "unknown");
    ended(command(api, &durable, &queued).await, "not_launched");

    // The events tell the story: lost (and fenced), restored from which
    // save, running again.
    let events = cluster.events(&durable).await;
    let recovering = event(&events, "recovering", 0);
    assert_eq!(recovering["reason"], "node_lost", "{recovering}");
    let message = recovering["message"].as_str().unwrap_or("");
    assert!(
        message.contains("expired") && message.contains("fences it"),
        "{recovering}"
    );
    assert!(parse_ms(recovering["at"].as_str().expect("at")) >= lost_at);
    let seq = recovering["seq"].as_u64().expect("seq");
    let placed = event(&events, "starting", seq);
    assert!(
        placed["message"]
            .as_str()
            .unwrap_or("")
            .contains("restoring the home's last completed save, taken at"),
        "{placed}"
    );
    assert_eq!(placed["runner_id"], cluster.runner_id(second).as_str());
    let running = event(&events, "running", placed["seq"].as_u64().expect("seq"));
    assert_eq!(running["epoch"], recovered["epoch"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_runner_freezes_before_its_lease_could_expire_and_thaws_with_nothing_lost() {
    // A long lease leaves room to heal after the freeze and before expiry.
    let mut cluster = Cluster::start(&["--lease-ttl", "15s"]).await;
    let host = cluster.host("a", "on_demand");
    let id = cluster
        .create(json!({"storage_class": "durable", "save_interval_s": 1}))
        .await;
    let api = cluster.api();
    let ticker = start_command(api, &id, TICKER).await;
    let ticks = cluster.hosts[host]
        .runner
        .data_dir
        .join("volumes/homes")
        .join(&id)
        .join("ticks");
    let epoch = cluster.get(&id).await["epoch"].clone();
    tokio::time::sleep(Duration::from_millis(500)).await;

    cluster.hosts[host].link.cut();
    let cut_at = now_ms();
    let deadline = Instant::now() + Duration::from_secs(20);
    let frozen_seen_at = loop {
        if cluster.hosts[host].runner.container_status(&id).as_deref() == Some("paused") {
            break now_ms();
        }
        assert!(Instant::now() < deadline, "the sandbox was never frozen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let lease_expires_at = parse_ms(
        cluster.runner_record(host).await["lease_expires_at"]
            .as_str()
            .expect("lease"),
    );
    assert!(
        frozen_seen_at < lease_expires_at,
        "frozen at {frozen_seen_at}, after the lease expired at {lease_expires_at} (cut at {cut_at})"
    );
    // Frozen means frozen: the workload writes nothing.
    let size = std::fs::metadata(&ticks).expect("ticks").len();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(std::fs::metadata(&ticks).expect("ticks").len(), size);
    // No save gets through: the record says saving is behind.
    assert!(
        eventually(Duration::from_secs(5), || async {
            cluster.get(&id).await["save"]["state"] == "delayed"
        })
        .await,
        "{}",
        cluster.get(&id).await
    );
    assert!(metric(&cluster.plane.admin, "roost_saves_delayed").await >= 1);

    cluster.hosts[host].link.heal();
    let api = cluster.api();
    assert!(
        eventually(Duration::from_secs(10), || async {
            cluster.hosts[host].runner.container_status(&id).as_deref() == Some("running")
        })
        .await,
        "the sandbox was not thawed"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        std::fs::metadata(&ticks).expect("ticks").len() > size,
        "not writing again"
    );
    let sandbox = cluster.get(&id).await;
    assert_eq!(sandbox["state"], "running", "{sandbox}");
    assert_eq!(sandbox["epoch"], epoch, "{sandbox}");
    assert_eq!(command(api, &id, &ticker).await["state"], "running");
    assert_eq!(cluster.runner_record(host).await["state"], "live");
    let saved = cluster.wait_saved(&id).await;
    assert_eq!(saved["save"]["state"], "ok", "{saved}");
    let events = cluster.events(&id).await;
    assert!(
        events
            .iter()
            .all(|e| e["state"] != "recovering" && e["state"] != "failed"),
        "{events:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_runner_is_replaced_and_fenced_and_nothing_it_wrote_after_the_fence_survives()
{
    let mut cluster = Cluster::start(&["--lease-ttl", "3s"]).await;
    let old = cluster.host("a", "on_demand");
    let id = cluster
        .create(json!({"storage_class": "durable", "save_interval_s": 1}))
        .await;
    let api = cluster.api();
    start_command(api, &id, TICKER).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.wait_saved(&id).await;
    let new = cluster.host("b", "on_demand");

    cluster.hosts[old].link.cut();
    let recovered = cluster
        .wait_running_on(&id, new, Duration::from_secs(30))
        .await;
    let events = cluster.events(&id).await;
    let fenced_at = parse_ms(event(&events, "recovering", 0)["at"].as_str().expect("at"));
    // The cut-off copy froze before the fence and wrote nothing since.
    let old_home = cluster.hosts[old]
        .runner
        .data_dir
        .join("volumes/homes")
        .join(&id)
        .join("ticks");
    let old_ticks = std::fs::read_to_string(&old_home).expect("the old copy's ticks");
    assert!(
        last_tick(&old_ticks) < fenced_at,
        "the old copy wrote at {} after the fence at {fenced_at}",
        last_tick(&old_ticks)
    );
    assert_eq!(
        cluster.hosts[old].runner.container_status(&id).as_deref(),
        Some("paused")
    );

    cluster.hosts[old].link.heal();
    // The old runner learns it was fenced: it kills its copy and removes it.
    assert!(
        eventually(Duration::from_secs(30), || async {
            cluster.hosts[old].runner.container_status(&id).is_none()
        })
        .await,
        "the fenced copy is still there: {:?}",
        cluster.hosts[old].runner.container_status(&id)
    );
    let fence: Value = serde_json::from_slice(
        &std::fs::read(cluster.hosts[old].runner.data_dir.join("fence.json")).expect("fence.json"),
    )
    .expect("json");
    assert_eq!(fence["state"], "fenced", "{fence}");
    // A late save of the old placement, as the old runner would send it
    // (of a root the store holds: only the placement can refuse it), is
    // refused with `fenced` (the placement below is unchanged).
    let before_late = cluster.get(&id).await;
    let old_credential =
        std::fs::read_to_string(cluster.hosts[old].runner.data_dir.join("runner-token"))
            .expect("the old runner's credential");
    let late = Api::new(&cluster.plane.server.url, old_credential.trim())
        .post(
            &format!("/v1/runner/sandboxes/{id}/saves"),
            json!({
                "runner_id": cluster.runner_id(old),
                "epoch": recovered["epoch"].as_u64().expect("epoch") - 1,
                "outcome": "completed",
                "root": before_late["save"]["root"],
            }),
        )
        .await;
    late.assert_error(409, "fenced");
    // The home the new copy runs on, and every later save of it, end
    // before the fence.
    let api = cluster.api();
    cluster.wait_saved(&id).await;
    let ticks = sh(api, &id, "cat /workspace/ticks").await;
    assert!(last_tick(&ticks) > 0, "the recovered home lost its ticks");
    assert!(
        last_tick(&ticks) < fenced_at,
        "a write after the fence came back"
    );
    let sandbox = cluster.get(&id).await;
    assert_eq!(sandbox["epoch"], recovered["epoch"], "{sandbox}");
    assert_eq!(sandbox["runner_id"], cluster.runner_id(new).as_str());
}

/// Every sandbox runs where it ran, at the same epoch, its ticker still
/// running and writing, no recovery in its history; every runner is live.
async fn assert_undisturbed(
    cluster: &Cluster,
    before: &[Value],
    tickers: &[(String, String)],
    when: &str,
) {
    for (record, (id, ticker)) in before.iter().zip(tickers) {
        let runner = record["runner_id"].as_str().expect("runner");
        let host = (0..cluster.hosts.len())
            .find(|h| cluster.runner_id(*h) == runner)
            .expect("host");
        let runs = || async {
            cluster.hosts[host].runner.container_status(id).as_deref() == Some("running")
        };
        assert!(
            eventually(Duration::from_secs(15), runs).await,
            "{when}: {id} does not run again"
        );
        let ticks = cluster.hosts[host]
            .runner
            .data_dir
            .join("volumes/homes")
            .join(id)
            .join("ticks");
        let size = std::fs::metadata(&ticks).expect("ticks").len();
        let grows = || async { std::fs::metadata(&ticks).expect("ticks").len() > size };
        assert!(
            eventually(Duration::from_secs(5), grows).await,
            "{when}: {id} does not write"
        );
        let now = cluster.get(id).await;
        assert_eq!(now["state"], "running", "{when}: {now}");
        assert_eq!(now["epoch"], record["epoch"], "{when}: {now}");
        assert_eq!(now["runner_id"], record["runner_id"], "{when}: {now}");
        let api = cluster.api();
        assert_eq!(command(api, id, ticker).await["state"], "running", "{when}");
        let events = cluster.events(id).await;
        assert!(
            events
                .iter()
                .all(|e| e["state"] != "recovering" && e["state"] != "failed"),
            "{when}: {events:#?}"
        );
    }
    for host in 0..cluster.hosts.len() {
        assert_eq!(cluster.runner_record(host).await["state"], "live", "{when}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutting_off_every_runner_or_restarting_the_server_recovers_nothing_and_loses_nothing() {
    let mut cluster = Cluster::start(&["--lease-ttl", "4s"]).await;
    let a = cluster.host("a", "on_demand");
    let durable = cluster.create(json!({"storage_class": "durable"})).await;
    let b = cluster.host("b", "spot");
    let standard = cluster.create(json!({})).await;
    let api = cluster.api();
    let tickers = vec![
        (durable.clone(), start_command(api, &durable, TICKER).await),
        (
            standard.clone(),
            start_command(api, &standard, TICKER).await,
        ),
    ];
    let before: Vec<Value> = vec![cluster.get(&durable).await, cluster.get(&standard).await];

    // Every runner cut off for longer than lease + margin: the control
    // plane is the likelier one cut off, so it holds.
    for host in [a, b] {
        cluster.hosts[host].link.cut();
    }
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert!(metric(&cluster.plane.admin, "roost_lease_holds_total").await > 0);
    for host in [a, b] {
        cluster.hosts[host].link.heal();
    }

    assert_undisturbed(
        &cluster,
        &before,
        &tickers,
        "after every runner was cut off",
    )
    .await;

    // The control plane down for longer than a lease.
    cluster.restart_server(Duration::from_secs(7)).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_undisturbed(&cluster, &before, &tickers, "after the server restarted").await;

    // The threshold is the operator's: above 1, nothing holds, and a fleet
    // cut off entirely is recovered (here: nowhere to go yet).
    cluster
        .server_args
        .extend(["--mass-loss-threshold".to_owned(), "1.01".to_owned()]);
    cluster.restart_server(Duration::ZERO).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    for host in [a, b] {
        cluster.hosts[host].link.cut();
    }
    let api = cluster.api();
    assert!(
        eventually(Duration::from_secs(20), || async {
            api.get(&format!("/v1/sandboxes/{durable}")).await.body["state"] == "recovering"
                && api.get(&format!("/v1/sandboxes/{standard}")).await.body["state"] == "failed"
        })
        .await,
        "nothing was recovered with the hold turned off: {} {}",
        cluster.get(&durable).await,
        cluster.get(&standard).await
    );
    for host in [a, b] {
        cluster.hosts[host].link.heal();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_and_drain_move_durable_sandboxes_without_losing_finished_work() {
    let mut cluster = Cluster::start(&["--lease-ttl", "3s"]).await;
    let spot = cluster.host("spot", "spot");
    let id = cluster.create(json!({"storage_class": "durable"})).await;
    assert_eq!(
        cluster.get(&id).await["runner_id"],
        cluster.runner_id(spot).as_str()
    );
    let on_demand = cluster.host("steady", "on_demand");
    let api = cluster.api();
    sh(
        api,
        &id,
        "mkdir -p /workspace/out && head -c 100000 /dev/urandom > /workspace/out/model.bin && echo ok > /workspace/out/status",
    )
    .await;
    let before = sh(api, &id, LISTING).await;

    // The spot host's interruption notice, as a cloud hook sends it.
    cluster.hosts[spot]
        .runner
        .signal(rustix::process::Signal::USR1);
    cluster
        .wait_running_on(&id, on_demand, Duration::from_secs(30))
        .await;
    let api = cluster.api();
    assert_eq!(sh(api, &id, LISTING).await, before);
    cluster.assert_event(&id, "securing", "preempted").await;
    let listed = cluster.admin_cli(&["runner", "list", "--json"]);
    assert!(listed.status.success(), "{listed:?}");
    let runners: Value = serde_json::from_slice(&listed.stdout).expect("json");
    let spot_record = runners["runners"]
        .as_array()
        .expect("list")
        .iter()
        .find(|r| r["id"] == cluster.runner_id(spot).as_str())
        .expect("spot runner listed")
        .clone();
    assert_eq!(spot_record["drain"], "preempt", "{spot_record}");

    // Only spot capacity is preempted.
    let refused = cluster.admin_cli(&["runner", "preempt", &cluster.runner_id(on_demand)]);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("only spot runners are preempted"),
        "{refused:?}"
    );

    // Drain for maintenance moves it back once the spot runner takes work.
    let undrained = cluster.admin_cli(&["runner", "undrain", &cluster.runner_id(spot)]);
    assert!(undrained.status.success(), "{undrained:?}");
    let drained = cluster.admin_cli(&["runner", "drain", &cluster.runner_id(on_demand)]);
    assert!(drained.status.success(), "{drained:?}");
    assert!(
        String::from_utf8_lossy(&drained.stdout).contains("being emptied (drain)"),
        "{drained:?}"
    );
    // A command sent while the sandbox moves is not handed to the runner
    // being emptied: it waits through the move and runs once it runs
    // again (on the spot runner), where it used to end `not_launched`.
    assert_eq!(sh(api, &id, "cat /workspace/out/status").await, "ok\n");
    cluster
        .wait_running_on(&id, spot, Duration::from_secs(30))
        .await;
    let api = cluster.api();
    assert_eq!(sh(api, &id, LISTING).await, before);
    cluster
        .assert_event(&id, "pending", "runner_draining")
        .await;
    // With the only on-demand runner drained, non_preemptible work waits:
    // it never lands on the spot runner.
    let pinned = api
        .post(
            "/v1/sandboxes",
            json!({"storage_class": "durable", "placement": "non_preemptible"}),
        )
        .await
        .str("id");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pinned_record = cluster.get(&pinned).await;
    assert_eq!(pinned_record["state"], "pending", "{pinned_record}");
    assert!(pinned_record["runner_id"].is_null(), "{pinned_record}");
    cluster.admin_cli(&["runner", "undrain", &cluster.runner_id(on_demand)]);
    cluster
        .wait_running_on(&pinned, on_demand, Duration::from_secs(30))
        .await;
}

/// A small seeded generator: the chaos test prints its seed, and
/// `ROOST_CHAOS_SEED` replays a run.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) % n
    }
}

/// Writes `EPOCH TIME_MS` lines to /workspace/ticks ten times a second.
const EPOCH_TICKER: &str =
    "while :; do echo \"$EPOCH $(date +%s%3N)\" >> /workspace/ticks; sleep 0.1; done";

/// When each epoch of a sandbox was fenced: the time of the first event
/// of a later epoch.
fn fence_times(events: &[Value]) -> Vec<(u64, i64)> {
    let mut fences = Vec::new();
    let mut current = 0;
    for event in events {
        let epoch = event["epoch"].as_u64().unwrap_or(0);
        if epoch > current {
            if current > 0 {
                fences.push((current, parse_ms(event["at"].as_str().expect("at"))));
            }
            current = epoch;
        }
    }
    fences
}

impl Cluster {
    /// Waits until every sandbox is recorded running on one of the hosts
    /// and that host's runtime shows its container running, at most
    /// `within`.
    async fn converge(&self, ids: &[String], within: Duration) {
        let api = self.api();
        let ok = eventually(within, || async {
            for id in ids {
                let record = api.get(&format!("/v1/sandboxes/{id}")).await.body;
                let host = record["runner_id"].as_str().and_then(|r| self.host_of(r));
                let runs = host.is_some_and(|h| {
                    self.hosts[h].runner.container_status(id).as_deref() == Some("running")
                });
                if record["state"] != "running" || !runs {
                    return false;
                }
            }
            true
        })
        .await;
        if !ok {
            let mut states = Vec::new();
            for id in ids {
                states.push(self.get(id).await);
            }
            panic!("the sandboxes did not all run again: {states:#?}");
        }
    }

    fn host_of(&self, runner_id: &str) -> Option<usize> {
        (0..self.hosts.len()).find(|h| self.runner_id(*h) == runner_id)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_keeps_every_committed_save_and_converges_every_record() {
    let seed = std::env::var("ROOST_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_ms() as u64 | 1);
    eprintln!("chaos seed {seed} (ROOST_CHAOS_SEED={seed} replays it)");
    let mut dice = Dice(seed);
    let mut cluster = Cluster::start(&["--lease-ttl", "3s"]).await;
    for name in ["a", "b", "c"] {
        cluster.host(name, "on_demand");
    }
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(
            cluster
                .create(json!({"storage_class": "durable", "save_interval_s": 1}))
                .await,
        );
    }
    let mut tickers: Vec<Option<String>> = vec![None; ids.len()];
    let mut committed: Vec<(String, String)> = Vec::new();
    let mut replaced = 0;
    let started = Instant::now();
    let mut round = 0;
    while round < 6 && started.elapsed() < Duration::from_secs(150) {
        round += 1;
        // Work: a ticker in each sandbox, a finished task saved.
        for (i, id) in ids.iter().enumerate() {
            let api = cluster.api();
            let running = match &tickers[i] {
                Some(ticker) => command(api, id, ticker).await["state"] == "running",
                None => false,
            };
            if !running {
                let epoch = cluster.get(id).await["epoch"].to_string();
                let created = api
                    .post(
                        &format!("/v1/sandboxes/{id}/commands"),
                        json!({"argv": ["sh", "-c", EPOCH_TICKER], "env": {"EPOCH": epoch}}),
                    )
                    .await;
                assert_eq!(created.status, 201, "{created:?}");
                tickers[i] = Some(created.str("id"));
            }
            let task = format!("task-{round}");
            sh(api, id, &format!("echo {round} > /workspace/{task}")).await;
            cluster.wait_saved(id).await;
            committed.push((id.clone(), task));
        }
        let host = dice.below(cluster.hosts.len() as u64) as usize;
        match dice.below(4) {
            0 => {
                eprintln!("chaos round {round}: kill -9 and restart runner {host}");
                cluster.hosts[host].runner.restart(&[]);
            }
            1 => {
                eprintln!("chaos round {round}: partition runner {host} past its lease");
                cluster.hosts[host].link.cut();
                tokio::time::sleep(Duration::from_secs(7)).await;
                cluster.hosts[host].link.heal();
            }
            2 => {
                eprintln!("chaos round {round}: restart the server");
                cluster.restart_server(Duration::from_secs(2)).await;
            }
            _ => {
                eprintln!("chaos round {round}: destroy runner {host} and start a fresh host");
                cluster.destroy(host);
                remove_cgroups(&cluster.hosts[host].cgroup);
                replaced += 1;
                let url = format!(
                    "http://{}:{}",
                    cluster.hosts[host].link.host_ip,
                    cluster.plane.port()
                );
                let data = cluster.data_dir(&format!("replacement-{replaced}"));
                let netns = cluster.hosts[host].link.netns.clone();
                let cgroup = format!("{netns}-replacement-{replaced}");
                cluster.hosts[host].cgroup = cgroup.clone();
                cluster.hosts[host].runner = RunnerProcess::start_in(
                    &url,
                    &cluster.plane.runner_token,
                    &data,
                    &[],
                    Some(&netns),
                    &["--placement-class", "on_demand", "--cgroup-parent", &cgroup],
                );
            }
        }
        cluster.converge(&ids, Duration::from_secs(60)).await;
    }
    eprintln!("chaos: {round} rounds in {:?}", started.elapsed());

    // Invariants, once everything has settled.
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.converge(&ids, Duration::from_secs(30)).await;
    let api = cluster.api();
    for id in &ids {
        // No committed save lost.
        let listing = sh(api, id, "ls /workspace").await;
        for (sandbox, task) in &committed {
            if sandbox == id {
                assert!(
                    listing.lines().any(|l| l == task),
                    "{id} lost {task}: {listing}"
                );
            }
        }
        // Nothing written by an epoch after it was fenced came back.
        let events = cluster.events(id).await;
        let fences = fence_times(&events);
        let ticks = sh(api, id, "cat /workspace/ticks").await;
        for line in ticks.lines() {
            let mut parts = line.split_whitespace();
            let (Some(epoch), Some(at)) = (parts.next(), parts.next()) else {
                continue;
            };
            let (epoch, at): (u64, i64) = (epoch.parse().expect("epoch"), at.parse().expect("ms"));
            if let Some((_, fenced_at)) = fences.iter().find(|(e, _)| *e == epoch) {
                assert!(
                    at < *fenced_at,
                    "{id}: epoch {epoch} wrote at {at}, after its fence at {fenced_at}"
                );
            }
        }
        // The record converged: running where a container runs.
        let record = cluster.get(id).await;
        let host = cluster
            .host_of(record["runner_id"].as_str().expect("runner"))
            .unwrap_or_else(|| panic!("{id} is on no host: {record}"));
        assert_eq!(
            cluster.hosts[host].runner.container_status(id).as_deref(),
            Some("running"),
            "{record}"
        );
        // Every command ended as what happened to it, or still runs.
        let commands = api
            .get(&format!("/v1/sandboxes/{id}/commands?limit=100"))
            .await;
        for c in commands.body["commands"].as_array().expect("commands") {
            let state = c["state"].as_str().unwrap_or("");
            if c["argv"][0] == "sh" && c["argv"][2] == EPOCH_TICKER {
                assert!(
                    [
                        "running",
                        "infrastructure_lost",
                        "unknown",
                        "interrupted",
                        "not_launched"
                    ]
                    .contains(&state),
                    "{c}"
                );
                if state == "running" {
                    assert_eq!(
                        c["epoch"], record["epoch"],
                        "a ticker of an old epoch runs: {c}"
                    );
                }
            } else {
                // The tasks: each ran to its end (the test waited for it).
                assert_eq!(state, "exited", "{c}");
            }
        }
    }
    // No container without a record: whatever a host runs is placed there.
    for host in 0..cluster.hosts.len() {
        let runtime = cluster.hosts[host].runner.runtime_root();
        let Ok(listing) = std::fs::read_dir(&runtime) else {
            continue;
        };
        for entry in listing.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("sbx_") {
                continue;
            }
            let status = cluster.hosts[host].runner.container_status(&name);
            if status.is_none() || status.as_deref() == Some("stopped") {
                continue;
            }
            let record = cluster.get(&name).await;
            assert_eq!(
                record["runner_id"],
                cluster.runner_id(host).as_str(),
                "host {host} runs {name} ({status:?}), which is placed elsewhere: {record}"
            );
        }
    }
}

/// Starts a workload in the sandbox's background (not a command: it
/// outlives its command and the runner) that appends the time in ms to
/// /workspace/FILE every 200 ms.
pub(crate) async fn start_stamper(api: &Api, id: &str, file: &str) {
    sh(
        api,
        id,
        &format!(
            "nohup sh -c 'while :; do date +%s%3N >> /workspace/{file}; sleep 0.2; done' \
             >/dev/null 2>&1 &"
        ),
    )
    .await;
}

/// Every stamp in a stamps file (none if it is missing).
pub(crate) fn stamps(path: &std::path::Path) -> Vec<i64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse::<i64>().ok())
        .collect()
}

/// A host's copy of a sandbox's home file.
fn home_file(cluster: &Cluster, host: usize, id: &str, file: &str) -> PathBuf {
    cluster.hosts[host]
        .runner
        .data_dir
        .join("volumes/homes")
        .join(id)
        .join(file)
}

/// The sandbox's init log on a host (`oci::init`: its freeze and thaw
/// lines).
fn init_log(cluster: &Cluster, host: usize, id: &str) -> String {
    let path = cluster.hosts[host]
        .runner
        .data_dir
        .join("sandboxes")
        .join(id)
        .join("bundle/init.log");
    std::fs::read_to_string(path).unwrap_or_default()
}

/// When the init finished stopping the sandbox's processes at the freeze
/// it is still in, as it recorded it: the freeze point. `None` while not
/// frozen. On a busy host a live runner can be late renewing its init's
/// lease: the init then freezes and continues once renewed, as designed,
/// and the workload's writes after that renewal are legitimate; only a
/// freeze no renewal followed is the one a dead runner left.
pub(crate) fn frozen_at(init_log: &str) -> Option<i64> {
    let mut frozen = None;
    for line in init_log.lines() {
        if line.starts_with("roost-init: lease lapsed") {
            frozen = line
                .rsplit_once("frozen_at_unix_ms=")
                .and_then(|(_, ms)| ms.trim().parse().ok());
        } else if line.starts_with("roost-init: lease renewed") {
            frozen = None;
        }
    }
    frozen
}

/// Issue 13, point 3: a runner process killed with its host up, and
/// nobody restarting it, left its sandbox running beside the copy
/// recovered elsewhere. Now its init stops the workload before the lease
/// could expire: nothing the old copy wrote is after its freeze point,
/// which is before the recovered copy's first write; the runner, once
/// restarted, kills the frozen copy and leaves the recovered one alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_runner_process_leaves_its_sandbox_frozen_and_its_copy_writes_nothing_after_the_freeze()
 {
    let mut cluster = Cluster::start(&["--lease-ttl", "3s"]).await;
    let old = cluster.host("a", "on_demand");
    let id = cluster
        .create(json!({"storage_class": "durable", "save_interval_s": 1}))
        .await;
    let api = cluster.api();
    start_stamper(api, &id, "stamps").await;
    cluster.wait_saved(&id).await;
    let new = cluster.host("b", "on_demand");

    let killed_at = now_ms();
    cluster.hosts[old].runner.kill9();
    let recovered = cluster
        .wait_running_on(&id, new, Duration::from_secs(30))
        .await;
    let api = cluster.api();
    start_stamper(api, &id, "stamps.b").await;
    let new_stamps = home_file(&cluster, new, &id, "stamps.b");
    assert!(
        eventually(Duration::from_secs(20), || async {
            stamps(&new_stamps).len() >= 10
        })
        .await,
        "the recovered copy does not write"
    );

    let log = init_log(&cluster, old, &id);
    let frozen_at =
        frozen_at(&log).unwrap_or_else(|| panic!("the old copy's init never froze: {log}"));
    let old_stamps = stamps(&home_file(&cluster, old, &id, "stamps"));
    let last_old = *old_stamps.iter().max().expect("the old copy wrote");
    let first_new = *stamps(&new_stamps)
        .iter()
        .min()
        .expect("the new copy wrote");
    let events = cluster.events(&id).await;
    let fenced_at = parse_ms(event(&events, "recovering", 0)["at"].as_str().expect("at"));
    // The workload outlived its runner until the freeze (so the init froze
    // it, not the kill)…
    assert!(
        last_old > killed_at,
        "the old copy stopped writing at {last_old}, before its runner was killed at {killed_at}"
    );
    // …wrote nothing after it, and the freeze came before the server moved
    // the sandbox and before the new copy's first write: never two writers.
    assert!(
        last_old <= frozen_at,
        "the old copy wrote at {last_old}, after its freeze at {frozen_at}"
    );
    assert!(
        frozen_at < fenced_at,
        "frozen at {frozen_at}, after the fence at {fenced_at}"
    );
    assert!(
        frozen_at < first_new,
        "frozen at {frozen_at}, after the new copy's first write at {first_new}"
    );
    // Frozen, not dead: the old container's init lives on.
    assert_eq!(
        cluster.hosts[old].runner.container_status(&id).as_deref(),
        Some("running")
    );

    // The runner comes back: not assigned the sandbox any more, it kills
    // its frozen copy (never renewing its lease); the new copy runs on.
    cluster.hosts[old].runner.restart(&[]);
    assert!(
        eventually(Duration::from_secs(30), || async {
            cluster.hosts[old].runner.container_status(&id).is_none()
        })
        .await,
        "the frozen copy is still there: {:?}",
        cluster.hosts[old].runner.container_status(&id)
    );
    let sandbox = cluster.get(&id).await;
    assert_eq!(sandbox["state"], "running", "{sandbox}");
    assert_eq!(sandbox["epoch"], recovered["epoch"], "{sandbox}");
    assert_eq!(sandbox["runner_id"], cluster.runner_id(new).as_str());
}

/// The other half of the contract: a runner that comes back before its
/// lease expired finds its sandboxes frozen by their inits, and thaws
/// them by renewing: the same processes write again, at the same epoch,
/// with no recovery in the sandbox's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_restarted_within_its_lease_thaws_what_its_inits_froze() {
    // Inits freeze 25 s after the last renewal's send; the server recovers
    // nothing before 31 s after its receipt: room for a restart.
    let mut cluster = Cluster::start(&["--lease-ttl", "30s"]).await;
    let host = cluster.host("a", "on_demand");
    let id = cluster
        .create(json!({"storage_class": "durable", "save_interval_s": 1}))
        .await;
    let api = cluster.api();
    start_stamper(api, &id, "stamps").await;
    let epoch = cluster.get(&id).await["epoch"].clone();
    let path = home_file(&cluster, host, &id, "stamps");
    assert!(
        eventually(Duration::from_secs(10), || async {
            !stamps(&path).is_empty()
        })
        .await,
        "the workload does not write"
    );

    cluster.hosts[host].runner.kill9();
    assert!(
        eventually(Duration::from_secs(40), || async {
            frozen_at(&init_log(&cluster, host, &id)).is_some()
        })
        .await,
        "the init never froze: {}",
        init_log(&cluster, host, &id)
    );
    let frozen_at = frozen_at(&init_log(&cluster, host, &id)).expect("frozen");
    let last = *stamps(&path).iter().max().expect("stamps");
    assert!(
        last <= frozen_at,
        "wrote at {last}, after the freeze at {frozen_at}"
    );

    cluster.hosts[host].runner.restart(&[]);
    assert!(
        eventually(Duration::from_secs(20), || async {
            stamps(&path).iter().max().is_some_and(|s| *s > frozen_at)
        })
        .await,
        "the workload was not thawed: {}",
        init_log(&cluster, host, &id)
    );
    assert!(
        init_log(&cluster, host, &id).contains("roost-init: lease renewed: continued"),
        "{}",
        init_log(&cluster, host, &id)
    );
    let sandbox = cluster.get(&id).await;
    assert_eq!(sandbox["state"], "running", "{sandbox}");
    assert_eq!(sandbox["epoch"], epoch, "{sandbox}");
    assert_eq!(sandbox["runner_id"], cluster.runner_id(host).as_str());
    let events = cluster.events(&id).await;
    assert!(
        events
            .iter()
            .all(|e| e["state"] != "recovering" && e["state"] != "failed"),
        "{events:#?}"
    );
}
