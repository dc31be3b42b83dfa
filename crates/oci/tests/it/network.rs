//! `bridge` and `none` networking under runc, checked from inside the
//! sandboxes and from the host: addresses and routes, reaching the host,
//! NAT to an "internet" (a network namespace the test makes and routes
//! through the host, so no real internet is needed), isolation between
//! sandboxes and from the outside, leases over delete and restart, and
//! recovery from interrupted setups.
//!
//! Every test's runtime uses the test bridge [`BRIDGE`] on [`SUBNET`],
//! apart from production's `roost0`, with its leases in a shared
//! directory (the bridge is shared, so its leases must be). The bridge and
//! its firewall chains stay after the run, as a runner's would; the
//! sandboxes' veths, namespaces and leases do not.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use oci::{
    BridgeConfig, BridgeNetwork, CommandSpec, Error, Lease, Limits, Network, Outcome, Runtime,
    RuntimeChoice, RuntimeConfig,
};
use tokio::io::AsyncReadExt;

use crate::support::{CGROUP_PARENT, TestSandbox, eventually, prepare};

const BRIDGE: &str = "rstit0";
const SUBNET: &str = "10.231.0.0/16";
const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 231, 0, 1);

/// A host port closed to the test bridge's sandboxes (as a runner closes
/// its data listener's), in every test's config: the bridge is shared and
/// each setup replaces its chains.
const CLOSED_HOST_PORT: u16 = 47_071;

fn bridge_config() -> BridgeConfig {
    let mut config = BridgeConfig::new(std::env::temp_dir().join("roost-runner-it-network"));
    config.bridge = BRIDGE.to_owned();
    config.subnet = SUBNET.parse().expect("valid subnet");
    config.closed_host_ports = vec![CLOSED_HOST_PORT];
    config
}

fn runtime_config(state_root: PathBuf, bridge: BridgeConfig) -> RuntimeConfig {
    let mut config = RuntimeConfig::new(RuntimeChoice::Runc, state_root);
    config.cgroup_parent = CGROUP_PARENT.to_owned();
    config.bridge = Some(bridge);
    config
}

/// A runc runtime with `bridge` set up, its state under `dir` as
/// [`TestSandbox`] expects.
fn bridge_runtime(dir: &Path, bridge: BridgeConfig) -> Runtime {
    let runtime = Runtime::open(runtime_config(dir.join("state"), bridge)).expect("runc runtime");
    assert!(
        runtime.bridge_available(),
        "bridge networking does not work here: {:?}",
        runtime.bridge_unavailable_reason()
    );
    runtime
}

/// A [`TestSandbox`] that also leaves nothing on the bridge, however the
/// test ends.
struct NetSandbox(TestSandbox);

impl std::ops::Deref for NetSandbox {
    type Target = TestSandbox;
    fn deref(&self) -> &TestSandbox {
        &self.0
    }
}

impl Drop for NetSandbox {
    fn drop(&mut self) {
        force_delete_container(&self.0);
        if let Some(bridge) = self.0.runtime.bridge() {
            let _ = bridge.detach(&self.0.config.id);
        }
    }
}

/// Deletes the container behind the runtime's back, as a crash would lose
/// it: the network stays.
fn force_delete_container(t: &TestSandbox) {
    let _ = Command::new(t.runtime.binary())
        .arg(format!("--root={}", t.state_root().display()))
        .args(["delete", "--force", t.config.id.as_str()])
        .stderr(std::process::Stdio::null())
        .status();
}

/// Listens on the port it is given and greets every connection.
const SERVER_PY: &str = "import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1])))
s.listen(16)
while True:
    c, _ = s.accept()
    c.sendall(b'hello from the sandbox')
    c.close()
";

/// `client.py HOST PORT TIMEOUT MESSAGE`: exit 0 once MESSAGE is sent.
const CLIENT_PY: &str = "import socket, sys
host, port, timeout, message = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
try:
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(message.encode())
except OSError as e:
    print('failed:', e)
    sys.exit(1)
print('connected')
";

const SANDBOX_PORT: u16 = 8080;

async fn launch(name: &str, network: Network, bridge: BridgeConfig) -> NetSandbox {
    let (dir, mut config) = prepare(name, Limits::default());
    config.network = network;
    let runtime = bridge_runtime(dir.path(), bridge);
    let sandbox = runtime.launch(&config).await.expect("sandbox launches");
    NetSandbox::new(TestSandbox::from_parts(sandbox, runtime, config, dir))
}

impl NetSandbox {
    /// With the client and server scripts in its workspace.
    fn new(t: TestSandbox) -> NetSandbox {
        std::fs::write(t.workspace.join("server.py"), SERVER_PY).expect("server script");
        std::fs::write(t.workspace.join("client.py"), CLIENT_PY).expect("client script");
        NetSandbox(t)
    }

    fn lease(&self) -> Lease {
        self.sandbox
            .lease()
            .expect("leases readable")
            .expect("the sandbox has a lease")
    }

    /// Whether the sandbox can open a TCP connection to `to` within
    /// `timeout_ms` (and send `message`).
    async fn connects(&self, to: SocketAddr, timeout_ms: u64, message: &str) -> bool {
        let ran = self
            .run(&CommandSpec::new([
                "python3".to_owned(),
                "/workspace/client.py".to_owned(),
                to.ip().to_string(),
                to.port().to_string(),
                format!("{}", timeout_ms as f64 / 1000.0),
                message.to_owned(),
            ]))
            .await;
        match ran.end.outcome {
            Outcome::Exited { code: 0 } => true,
            Outcome::Exited { code: 1 } if ran.stdout.starts_with("failed:") => false,
            other => panic!(
                "client did not run: {other:?}: {} {}",
                ran.stdout, ran.stderr
            ),
        }
    }

    /// Starts the greeting server on [`SANDBOX_PORT`] and waits until the
    /// host can connect to it.
    async fn serve(&self) -> SocketAddr {
        self.sh_ok(&format!(
            "python3 /workspace/server.py {SANDBOX_PORT} >/dev/null 2>&1 &"
        ))
        .await;
        let address = SocketAddr::from((self.lease().address, SANDBOX_PORT));
        assert!(
            eventually(Duration::from_secs(5), || {
                TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_ok()
            })
            .await,
            "the host cannot reach the sandbox's server at {address}"
        );
        address
    }
}

/// A listener on the bridge's host side, accepting one connection.
async fn host_listener() -> (
    SocketAddr,
    tokio::task::JoinHandle<Option<(SocketAddr, String)>>,
) {
    let listener = tokio::net::TcpListener::bind((GATEWAY, 0))
        .await
        .expect("listen on the bridge address");
    let address = listener.local_addr().expect("address");
    (address, accept_one(listener))
}

/// The peer and message of the first connection within 5 s.
fn accept_one(
    listener: tokio::net::TcpListener,
) -> tokio::task::JoinHandle<Option<(SocketAddr, String)>> {
    tokio::spawn(async move {
        let within = Duration::from_secs(5);
        let (mut stream, peer) = tokio::time::timeout(within, listener.accept())
            .await
            .ok()?
            .ok()?;
        let mut text = String::new();
        tokio::time::timeout(within, stream.read_to_string(&mut text))
            .await
            .ok()?
            .ok()?;
        Some((peer, text))
    })
}

fn host(program: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} {args:?}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn interface_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Runs `work` on a thread moved into the named network namespace; a
/// socket made there stays in it.
fn in_netns<T: Send + 'static>(name: &str, work: impl FnOnce() -> T + Send + 'static) -> T {
    let path = Path::new("/run/netns").join(name);
    std::thread::spawn(move || {
        let namespace = std::fs::File::open(&path).expect("open the namespace");
        rustix::thread::move_into_link_name_space(
            namespace.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .expect("setns");
        work()
    })
    .join()
    .expect("namespace thread")
}

/// "The internet": a network namespace behind a veth from the host,
/// `198.51.100.2` (and a link-local `169.254.77.77`, standing in for a
/// cloud metadata service) on its side, `198.51.100.1` on the host's. It
/// has a route back to the sandbox subnet, so only NAT explains a
/// connection arriving from the host's address. Its names and addresses
/// are fixed, so a file lock keeps test processes running at once on one
/// host from sharing it.
struct Internet {
    _lock: std::fs::File,
}

const INTERNET_NETNS: &str = "roost-it-internet";
const INTERNET_LINK: &str = "rstit-inet";
const INTERNET_HOST_SIDE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const INTERNET_ADDRESS: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const METADATA_ADDRESS: Ipv4Addr = Ipv4Addr::new(169, 254, 77, 77);

impl Internet {
    fn create() -> Internet {
        let lock_path = std::env::temp_dir().join("roost-runner-it-internet.lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .expect("open the lock file");
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).expect("flock");
        Internet::remove();
        host("ip", &["netns", "add", INTERNET_NETNS]);
        let internet = Internet { _lock: lock };
        host(
            "ip",
            &[
                "link",
                "add",
                INTERNET_LINK,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                INTERNET_NETNS,
            ],
        );
        host(
            "ip",
            &["address", "add", "198.51.100.1/24", "dev", INTERNET_LINK],
        );
        host("ip", &["link", "set", INTERNET_LINK, "up"]);
        host(
            "ip",
            &["route", "add", "169.254.77.77/32", "via", "198.51.100.2"],
        );
        let inside = |args: &[&str]| {
            let mut all = vec!["-n", INTERNET_NETNS];
            all.extend_from_slice(args);
            host("ip", &all);
        };
        inside(&["address", "add", "198.51.100.2/24", "dev", "eth0"]);
        inside(&["address", "add", "169.254.77.77/32", "dev", "eth0"]);
        inside(&["link", "set", "eth0", "up"]);
        inside(&["link", "set", "lo", "up"]);
        inside(&["route", "add", SUBNET, "via", "198.51.100.1"]);
        internet
    }

    fn remove() {
        // Deleting the veth takes the host route through it along.
        for args in [
            &["link", "del", INTERNET_LINK][..],
            &["netns", "del", INTERNET_NETNS][..],
        ] {
            let _ = Command::new("ip")
                .args(args)
                .stderr(std::process::Stdio::null())
                .status();
        }
    }

    fn listen(&self) -> tokio::net::TcpListener {
        let listener = in_netns(INTERNET_NETNS, || {
            std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))
        })
        .expect("listen in the internet");
        listener.set_nonblocking(true).expect("nonblocking");
        tokio::net::TcpListener::from_std(listener).expect("tokio listener")
    }

    fn connects(&self, to: SocketAddr) -> bool {
        in_netns(INTERNET_NETNS, move || {
            TcpStream::connect_timeout(&to, Duration::from_millis(500)).is_ok()
        })
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        Internet::remove();
    }
}

#[tokio::test]
async fn a_bridge_sandbox_has_eth0_with_its_address_a_default_route_and_dns() {
    let resolv = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(
        resolv.path(),
        "nameserver 127.0.0.53\nnameserver 192.0.2.53\nsearch it.example\n",
    )
    .expect("write resolv.conf");
    let mut bridge = bridge_config();
    bridge.resolv_conf = resolv.path().to_owned();
    let t = launch("net-eth0", Network::Bridge, bridge).await;
    let lease = t.lease();
    assert!(lease.subnet.contains(lease.address), "{lease:?}");
    assert_ne!(lease.address, GATEWAY);
    assert_eq!(lease.gateway(), GATEWAY);

    assert_eq!(t.sh_ok("ls /sys/class/net").await, "eth0\nlo\n");
    let eth0 = t.sh_ok("ip -4 -o address show dev eth0").await;
    assert!(
        eth0.contains(&format!("inet {}/16", lease.address)),
        "{eth0}"
    );
    assert_eq!(
        t.sh_ok("ip route show default").await.trim(),
        "default via 10.231.0.1 dev eth0"
    );
    let lo = t.sh_ok("ip -o link show dev lo").await;
    assert!(lo.contains(",UP"), "loopback is down: {lo}");
    assert_eq!(t.sh_ok("ip -6 -o address show dev eth0").await, "");
    assert_eq!(
        t.sh_ok("grep -v '^#' /etc/resolv.conf").await,
        "nameserver 192.0.2.53\nsearch it.example\n"
    );
    // No CAP_NET_ADMIN: the sandbox cannot take another address (the
    // isolation rules rely on that).
    let ran = t.sh("ip address add 10.231.255.1/16 dev eth0").await;
    assert_ne!(
        ran.end.outcome,
        Outcome::Exited { code: 0 },
        "address added"
    );
    assert!(
        ran.stderr.contains("Operation not permitted"),
        "{}",
        ran.stderr
    );

    // The host end: a port of the bridge, isolated from the others.
    let veth = &lease.host_interface;
    let master = std::fs::read_link(format!("/sys/class/net/{veth}/master")).expect("enslaved");
    assert_eq!(master.file_name().and_then(|n| n.to_str()), Some(BRIDGE));
    let details = host("ip", &["-d", "link", "show", "dev", veth]);
    assert!(details.contains("isolated on"), "{details}");
}

#[tokio::test]
async fn a_bridge_sandbox_reaches_the_host_and_the_outside_through_nat_but_nothing_reaches_in() {
    let t = launch("net-nat", Network::Bridge, bridge_config()).await;
    let lease = t.lease();

    // The host, on the bridge address: no NAT on the way, the host sees
    // the sandbox's own address.
    let (host_address, accepted) = host_listener().await;
    assert!(t.connects(host_address, 2000, "to the host").await);
    let (peer, text) = accepted.await.expect("task").expect("a connection");
    assert_eq!(peer.ip(), lease.address);
    assert_eq!(text, "to the host");

    // The outside, through the host: masqueraded to the host's address.
    let internet = Internet::create();
    let listener = internet.listen();
    let port = listener.local_addr().expect("address").port();
    let accepted = accept_one(listener);
    let outside = SocketAddr::from((INTERNET_ADDRESS, port));
    assert!(t.connects(outside, 2000, "to the internet").await);
    let (peer, text) = accepted.await.expect("task").expect("a connection");
    assert_eq!(text, "to the internet");
    assert_eq!(
        peer.ip(),
        INTERNET_HOST_SIDE,
        "the outside saw the sandbox's own address: not masqueraded"
    );

    // Link-local destinations (cloud metadata) stay out of reach, though
    // the host routes there and something listens (the kernel completes
    // handshakes for a listener nobody accepts on).
    let metadata = internet.listen();
    let metadata_port = metadata.local_addr().expect("address").port();
    let to_metadata = SocketAddr::from((METADATA_ADDRESS, metadata_port));
    assert!(
        !t.connects(to_metadata, 1000, "x").await,
        "the sandbox reached a link-local address"
    );
    // The same listener through the internet's ordinary address: the
    // refusal above was the destination's, not the listener's.
    let to_listener = SocketAddr::from((INTERNET_ADDRESS, metadata_port));
    assert!(t.connects(to_listener, 2000, "x").await);
    drop(metadata);

    // Nothing from outside starts a connection to a sandbox, though the
    // host itself can (and the outside has a route).
    let server = t.serve().await;
    assert!(
        !internet.connects(server),
        "the outside connected to the sandbox's server"
    );
}

#[tokio::test]
async fn a_closed_host_port_is_refused_to_a_bridge_sandbox_and_other_ports_are_not() {
    let t = launch("net-closed", Network::Bridge, bridge_config()).await;
    let closed = tokio::net::TcpListener::bind((GATEWAY, CLOSED_HOST_PORT))
        .await
        .expect("listen on the closed port");
    let accepted = accept_one(closed);
    assert!(
        !t.connects(SocketAddr::from((GATEWAY, CLOSED_HOST_PORT)), 2000, "x")
            .await,
        "the sandbox reached a closed host port"
    );
    assert!(
        accepted.await.expect("task").is_none(),
        "the closed port accepted"
    );
    // The host's other ports stay as reachable as before.
    let (open, accepted) = host_listener().await;
    assert!(t.connects(open, 2000, "open").await);
    assert!(accepted.await.expect("task").is_some());
}

#[tokio::test]
async fn bridge_sandboxes_cannot_reach_each_other() {
    let a = launch("net-a", Network::Bridge, bridge_config()).await;
    let b = launch("net-b", Network::Bridge, bridge_config()).await;
    let (lease_a, lease_b) = (a.lease(), b.lease());
    assert_ne!(lease_a.address, lease_b.address);
    let server = a.serve().await;

    // On the link: the bridge forwards nothing between isolated ports.
    assert!(
        !b.connects(server, 1000, "neighbour").await,
        "sandbox b reached sandbox a on the bridge"
    );
    // Through the gateway, as sandboxes that could change their routes
    // would try (the host adds the routes, both ways, since a sandbox has
    // no CAP_NET_ADMIN): the host does not route from the bridge back
    // into it.
    for (from, to) in [(&b, &lease_a), (&a, &lease_b)] {
        let netns = oci::network::netns_name(&from.config.id);
        host(
            "ip",
            &[
                "-n",
                &netns,
                "route",
                "add",
                &format!("{}/32", to.address),
                "via",
                &GATEWAY.to_string(),
            ],
        );
    }
    assert!(
        !b.connects(server, 1000, "routed").await,
        "sandbox b reached sandbox a through the host"
    );
    // Both still reach the host: what failed was only the neighbour.
    let (host_address, accepted) = host_listener().await;
    assert!(b.connects(host_address, 2000, "b").await);
    assert!(accepted.await.expect("task").is_some());
}

#[tokio::test]
async fn a_none_sandbox_has_only_loopback_and_cannot_reach_the_host() {
    // On a runtime with the bridge up: `none` must not get any of it.
    let t = launch("net-none", Network::None, bridge_config()).await;
    assert_eq!(t.sh_ok("ls /sys/class/net").await, "lo\n");
    let lo = t.sh_ok("ip -o link show dev lo").await;
    assert!(lo.contains(",UP"), "loopback is down: {lo}");
    assert_eq!(t.sh_ok("ip route show").await, "");
    assert_eq!(t.sandbox.lease().expect("leases readable"), None);
    let netns = oci::network::netns_path(&t.config.id);
    assert!(!netns.exists(), "{} exists", netns.display());

    let (host_address, accepted) = host_listener().await;
    assert!(
        !t.connects(host_address, 1000, "none").await,
        "a none sandbox reached the host"
    );
    accepted.abort();
}

#[tokio::test]
async fn two_sandboxes_get_distinct_addresses_and_delete_frees_them() {
    let a = launch("net-del-a", Network::Bridge, bridge_config()).await;
    let b = launch("net-del-b", Network::Bridge, bridge_config()).await;
    let (lease_a, lease_b) = (a.lease(), b.lease());
    assert_ne!(lease_a.address, lease_b.address);
    assert_ne!(lease_a.host_interface, lease_b.host_interface);
    // What each sandbox sees is its own lease.
    let seen_b = b.sh_ok("ip -4 -o address show dev eth0").await;
    assert!(
        seen_b.contains(&format!("inet {}/", lease_b.address)),
        "{seen_b}"
    );
    assert!(interface_exists(&lease_a.host_interface));
    let netns_a = oci::network::netns_path(&a.config.id);
    assert!(netns_a.exists());

    a.sandbox.delete().await.expect("delete");
    assert!(
        !interface_exists(&lease_a.host_interface),
        "the veth outlived its sandbox"
    );
    assert!(!netns_a.exists(), "the namespace outlived its sandbox");
    assert_eq!(a.sandbox.lease().expect("leases readable"), None);
    let lease_file = bridge_config()
        .state_dir
        .join("leases")
        .join(lease_a.address.to_string());
    assert!(
        std::fs::symlink_metadata(&lease_file).is_err(),
        "{} still leased",
        lease_file.display()
    );
    a.sandbox.delete().await.expect("delete is idempotent");

    // The other sandbox is untouched.
    assert!(interface_exists(&lease_b.host_interface));
    let (host_address, accepted) = host_listener().await;
    assert!(b.connects(host_address, 2000, "still here").await);
    assert!(accepted.await.expect("task").is_some());
}

#[tokio::test]
async fn leases_survive_a_runner_restart() {
    let a = launch("net-restart", Network::Bridge, bridge_config()).await;
    let lease_a = a.lease();

    // A new runtime over the same state: the runner after a restart.
    let restarted =
        Runtime::open(runtime_config(a.state_root(), bridge_config())).expect("runtime reopens");
    assert!(restarted.bridge_available());
    let handle = restarted.sandbox(a.config.id.clone(), a.config.paths.clone());
    assert_eq!(handle.lease().expect("readable"), Some(lease_a.clone()));
    let ids = restarted.container_ids().expect("list");
    assert!(ids.contains(&a.config.id.to_string()), "{ids:?}");

    // It frees what the earlier run gave: container, veth, lease.
    handle.delete().await.expect("delete");
    assert!(!interface_exists(&lease_a.host_interface));
    assert_eq!(handle.lease().expect("readable"), None);
    assert!(restarted.container_ids().expect("list").is_empty());
}

#[tokio::test]
async fn setup_after_an_interrupted_one_succeeds() {
    let (dir, mut config) = prepare("net-crash", Limits::default());
    config.network = Network::Bridge;
    let runtime = bridge_runtime(dir.path(), bridge_config());
    let bridge: BridgeNetwork = runtime.bridge().expect("bridge").clone();

    // Interrupted between the network and the container: a lease, a veth
    // and a namespace, no container.
    let first = bridge.attach(&config.id, &config.paths).expect("attach");
    assert!(interface_exists(&first.host_interface));
    let index = |name: &str| {
        std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex")).expect("ifindex")
    };
    let leftover = index(&first.host_interface);
    let sandbox = runtime
        .launch(&config)
        .await
        .expect("launch over leftovers");
    let t = NetSandbox::new(TestSandbox::from_parts(sandbox, runtime, config, dir));
    assert_eq!(t.lease(), first, "the lease was not reused");
    assert_ne!(
        index(&first.host_interface),
        leftover,
        "the leftover veth was kept"
    );
    let (host_address, accepted) = host_listener().await;
    assert!(t.connects(host_address, 2000, "first").await);
    assert!(accepted.await.expect("task").is_some());

    // The container lost (a crash took the runtime's state): veth,
    // namespace and lease left behind, and the sandbox created again.
    force_delete_container(&t);
    assert!(interface_exists(&first.host_interface));
    let leftover = index(&first.host_interface);
    let sandbox = t.runtime.launch(&t.config).await.expect("launch again");
    assert_eq!(sandbox.lease().expect("readable"), Some(first.clone()));
    assert_ne!(index(&first.host_interface), leftover);
    let eth0 = t.sh_ok("ip -4 -o address show dev eth0").await;
    assert!(eth0.contains(&format!("inet {}/", first.address)), "{eth0}");
    let (host_address, accepted) = host_listener().await;
    assert!(t.connects(host_address, 2000, "again").await);
    assert!(accepted.await.expect("task").is_some());
}

#[test]
fn setup_is_idempotent_and_teardown_removes_it() {
    crate::support::require_root_and_runc();
    let state = tempfile::tempdir().expect("temp dir");
    let mut config = BridgeConfig::new(state.path());
    config.bridge = "rstit1".to_owned();
    config.subnet = "10.232.0.0/24".parse().expect("valid");
    config.mtu = Some(1400);
    let network = BridgeNetwork::new(config).expect("valid");
    let jumps = |table: &str, chain: &str, target: &str| {
        host("iptables", &["-w", "-t", table, "-S", chain])
            .lines()
            .filter(|line| line.ends_with(&format!("-j {target}")))
            .count()
    };
    for _ in 0..2 {
        network.setup().expect("setup");
    }
    assert_eq!(jumps("filter", "FORWARD", "ROOST-FWD-rstit1"), 1);
    assert_eq!(jumps("filter", "INPUT", "ROOST-IN-rstit1"), 1);
    assert_eq!(jumps("nat", "POSTROUTING", "ROOST-NAT-rstit1"), 1);
    let chain = host("iptables", &["-w", "-S", "ROOST-FWD-rstit1"]);
    assert_eq!(chain.lines().count(), 6, "{chain}"); // -N and five rules
    let addresses = host("ip", &["-o", "-4", "address", "show", "dev", "rstit1"]);
    assert_eq!(addresses.matches("10.232.0.1/24").count(), 1, "{addresses}");
    assert_eq!(
        std::fs::read_to_string("/sys/class/net/rstit1/mtu").expect("mtu"),
        "1400\n"
    );
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").expect("sysctl"),
        "1\n"
    );

    network.teardown().expect("teardown");
    assert!(!interface_exists("rstit1"));
    assert_eq!(jumps("filter", "FORWARD", "ROOST-FWD-rstit1"), 0);
    assert_eq!(jumps("filter", "INPUT", "ROOST-IN-rstit1"), 0);
    assert_eq!(jumps("nat", "POSTROUTING", "ROOST-NAT-rstit1"), 0);
    let gone = Command::new("iptables")
        .args(["-w", "-S", "ROOST-FWD-rstit1"])
        .output()
        .expect("iptables");
    assert!(!gone.status.success(), "the chain outlived teardown");
    network.teardown().expect("teardown is idempotent");
}

#[tokio::test]
async fn a_host_that_cannot_bridge_refuses_bridge_sandboxes() {
    let (dir, mut config) = prepare("net-refused", Limits::default());
    config.network = Network::Bridge;
    // `lo` exists and is no bridge: setup must refuse it, touching nothing.
    let mut bridge = bridge_config();
    bridge.bridge = "lo".to_owned();
    let mut runtime_config = RuntimeConfig::new(RuntimeChoice::Runc, dir.path().join("state"));
    runtime_config.cgroup_parent = CGROUP_PARENT.to_owned();
    runtime_config.bridge = Some(bridge);
    let runtime = Runtime::open(runtime_config).expect("the runtime opens without a bridge");
    assert!(!runtime.bridge_available());
    let reason = runtime.bridge_unavailable_reason().expect("a reason");
    assert!(
        reason.contains("lo exists on this host and is not a bridge"),
        "{reason}"
    );

    let error = runtime.create(&config).await.expect_err("bridge refused");
    assert!(matches!(error, Error::Unsupported(_)), "{error}");
    assert!(error.to_string().contains("not a bridge"), "{error}");
    assert!(runtime.container_ids().expect("list").is_empty());
    assert!(
        !config.paths.dir().exists(),
        "files written for a refused sandbox"
    );
}
