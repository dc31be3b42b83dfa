//! `bridge` networking: a runner-level Linux bridge with a private IPv4
//! subnet, one veth pair per sandbox into its own network namespace,
//! outbound NAT, and nothing else.
//!
//! ```text
//!   host                                         sandbox netns "roost-ID"
//!   ──────────────────────────────────────────   ─────────────────────────
//!   roost0 (bridge, 10.88.0.1/16, no IPv6)
//!     └─ port roost0-5 (veth, isolated) ◄──────► eth0 10.88.0.5/16
//!                                                default via 10.88.0.1
//!   iptables filter FORWARD → ROOST-FWD-roost0    lo up
//!   iptables filter INPUT → ROOST-IN-roost0
//!   iptables nat POSTROUTING → ROOST-NAT-roost0   /etc/resolv.conf (ours)
//! ```
//!
//! # What a sandbox on the bridge can and cannot reach
//!
//! - **Out**: anything the host can route to, masqueraded to the host's
//!   address on the way out (`ROOST-NAT-*`), except link-local destinations
//!   (`169.254.0.0/16`: cloud metadata services hand out credentials).
//! - **The host**: yes, like Docker's `docker0`: the bridge address and the
//!   host's other addresses are local to the host, so traffic to them is
//!   `INPUT`, not forwarded. A runner host must not expose services to its
//!   sandboxes that it would not expose to them anyway (bind them to
//!   loopback or firewall the bridge in `INPUT`). The runner closes its own
//!   data listener's port to them (`ROOST-IN-*`, jumped to from `INPUT`,
//!   [`BridgeConfig::closed_host_ports`]).
//! - **Other sandboxes**: no. Every sandbox port is a bridge port with
//!   `isolated on`, so the bridge never forwards a frame from one sandbox
//!   port to another (ARP included), and `ROOST-FWD-*` drops anything
//!   routed from the bridge back into it, should a sandbox send to its
//!   neighbour through the gateway. Both hold only because a sandbox cannot
//!   change its own interface, routes or addresses, nor forge frames: its
//!   capability set has neither `CAP_NET_ADMIN` nor `CAP_NET_RAW` (see
//!   [`crate::security::CAPABILITIES`]). The rules therefore key on interfaces,
//!   never on source addresses.
//! - **In from outside**: nothing beyond the host starts a connection to a
//!   sandbox: `ROOST-FWD-*` forwards into the bridge only packets of
//!   connections a sandbox opened (conntrack `ESTABLISHED,RELATED`). There
//!   are no port forwards. (The host itself can connect to a sandbox: that
//!   is local output, not forwarding.)
//! - **IPv6**: none. The bridge has IPv6 disabled and the sandbox's `eth0`
//!   generates no link-local address, so there is no IPv6 path at all.
//!
//! # How the namespace is joined
//!
//! The network namespace is a *named* one (`ip netns add roost-ID`, a bind
//! mount at `/run/netns/roost-ID`), plumbed completely **before** the
//! runtime's `create`, and the OCI config's network namespace carries its
//! `path`, which the runtime joins with `setns(2)` instead of making a new
//! one (standard OCI; the tests run it under runc). The other way, letting the runtime make the namespace and
//! moving the veth into `/proc/PID/ns/net` between `create` and `start`,
//! works with runc too, but:
//!
//! - the namespace is found by name, not by a pid: nothing to race,
//!   nothing to re-discover after a runner restart, and clean-up after a
//!   crash at any step is "delete whatever has this sandbox's names";
//! - every failure happens before a container exists, so a failed setup
//!   never leaves a container to kill, and `ip -n NAME` configures the
//!   inside without `nsenter`;
//! - the cost is that the runtime no longer brings `lo` up in a namespace
//!   it did not make (runc only does that for namespaces it creates), so
//!   this module does, with the rest.
//!
//! `none` is untouched by all of this: the runtime makes a fresh namespace
//! with only loopback, as before.
//!
//! # Addresses
//!
//! An address is leased to a sandbox by a symlink `STATE/leases/10.88.0.5 →
//! SANDBOX_ID`. `symlink(2)` creates name and content in one atomic step
//! and fails if the name exists, so two allocations (two threads, two
//! processes) can never take the same address, and a lease is never seen
//! half-written. Leases are on disk, so they survive a runner restart;
//! [`BridgeNetwork::detach`] (called by [`crate::Sandbox::delete`]) frees
//! them. The host-side interface is named after the bridge and the address
//! (`roost0-5`), so a leftover one is found again from the lease alone.
//!
//! # Crash safety
//!
//! [`BridgeNetwork::attach`] takes the lease first (reusing the sandbox's
//! own lease if a crashed attempt left one), then deletes whatever a
//! previous attempt may have left under this sandbox's names (the veth,
//! the namespace), then builds them again. A failed attach undoes itself;
//! a crash in the middle leaves only things the next attach or a delete
//! removes. Detach removes the veth and the namespace first and the lease
//! last, so an address is never free while something still uses it.
//!
//! # Host commands
//!
//! Everything goes through `ip` (iproute2), `iptables` and
//! `iptables-restore` as child processes (`ip -batch` keeps a sandbox's
//! plumbing to two of them). iptables rather than a private nft table:
//! an `accept` in one nft table does not override a `drop` policy in
//! another, so on hosts whose `FORWARD` policy is `DROP` (Docker, ufw) only
//! a rule in the `FORWARD` chain itself lets sandbox traffic through.
//! The commands are the same for iptables-nft and iptables-legacy (the
//! tests run iptables-nft), all through [`crate::host::run_tool`]. The
//! functions here block: async code calls them through
//! [`crate::host::blocking`] (as [`crate::Runtime`] does).

use std::collections::BTreeSet;
use std::fmt;
use std::io::ErrorKind;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};

use crate::config::{SandboxId, SandboxPaths};
use crate::error::{Error, Result};
use crate::host::{ToolFailureKind, find_binary, run_tool, sync_dir, write_file};

/// The bridge every runner uses unless configured otherwise.
pub const DEFAULT_BRIDGE: &str = "roost0";
/// The private subnet of the default bridge.
pub const DEFAULT_SUBNET: &str = "10.88.0.0/16";
/// Where `ip netns` keeps named network namespaces.
pub const NETNS_DIR: &str = "/run/netns";
/// The host DNS configuration a sandbox's is derived from.
pub const DEFAULT_RESOLV_CONF: &str = "/etc/resolv.conf";
/// systemd-resolved's list of upstream servers: used when the host's own
/// resolv.conf only names a local stub the sandbox cannot reach.
pub const RESOLVED_UPSTREAM_CONF: &str = "/run/systemd/resolve/resolv.conf";
/// The longest bridge name: its ports are named `BRIDGE-OFFSET` with up to
/// six hex digits of offset, and interface names hold 15 bytes.
pub const BRIDGE_NAME_BYTES_MAX: usize = 8;
/// Subnets from /8 (the offset fits six hex digits) to /30 (one sandbox).
pub const SUBNET_PREFIX_MIN: u8 = 8;
pub const SUBNET_PREFIX_MAX: u8 = 30;
/// MTU bounds accepted in [`BridgeConfig::mtu`].
pub const MTU_MIN: u32 = 576;
pub const MTU_MAX: u32 = 65_535;
/// Used when the host has no default route to take the MTU from.
pub const MTU_FALLBACK: u32 = 1500;
/// The sandbox's interface name.
pub const SANDBOX_INTERFACE: &str = "eth0";
/// Destinations a sandbox may not reach even through NAT: link-local
/// addresses, where cloud metadata services hand out the host's
/// credentials.
pub const BLOCKED_DESTINATIONS: &[&str] = &["169.254.0.0/16"];

/// Host-wide setup (bridge, sysctls, firewall) is one at a time within a
/// process: `iptables -C` then `-I` is not atomic, and two runtimes opened
/// at once (tests do) must not both insert the jump.
static SETUP_LOCK: Mutex<()> = Mutex::new(());

/// An IPv4 subnet `NETWORK/PREFIX` with its host bits zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ipv4Subnet {
    network: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Subnet {
    pub fn new(network: Ipv4Addr, prefix: u8) -> Result<Self> {
        if !(SUBNET_PREFIX_MIN..=SUBNET_PREFIX_MAX).contains(&prefix) {
            return Err(Error::Invalid(format!(
                "subnet {network}/{prefix}: use a prefix from /{SUBNET_PREFIX_MIN} to /{SUBNET_PREFIX_MAX}"
            )));
        }
        let subnet = Ipv4Subnet { network, prefix };
        if u32::from(network) & !subnet.mask() != 0 {
            return Err(Error::Invalid(format!(
                "subnet {network}/{prefix} has host bits set: use {}/{prefix}",
                Ipv4Addr::from(u32::from(network) & subnet.mask())
            )));
        }
        Ok(subnet)
    }

    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    fn mask(&self) -> u32 {
        u32::MAX << (32 - u32::from(self.prefix))
    }

    /// Addresses in the subnet, network and broadcast included.
    fn size(&self) -> u32 {
        1u32 << (32 - u32::from(self.prefix))
    }

    /// The first host address: the bridge's own, every sandbox's gateway.
    pub fn gateway(&self) -> Ipv4Addr {
        self.address(1)
    }

    pub fn contains(&self, address: Ipv4Addr) -> bool {
        u32::from(address) & self.mask() == u32::from(self.network)
    }

    fn address(&self, offset: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + offset)
    }

    fn offset(&self, address: Ipv4Addr) -> Option<u32> {
        self.contains(address)
            .then(|| u32::from(address) - u32::from(self.network))
    }

    /// Offsets a sandbox may get: after the gateway, before the broadcast.
    fn sandbox_offsets(&self) -> std::ops::RangeInclusive<u32> {
        2..=self.size() - 2
    }
}

impl FromStr for Ipv4Subnet {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let invalid = || Error::Invalid(format!("subnet {text:?}: write it as 10.88.0.0/16"));
        let (network, prefix) = text.split_once('/').ok_or_else(invalid)?;
        let network: Ipv4Addr = network.parse().map_err(|_| invalid())?;
        let prefix: u8 = prefix.parse().map_err(|_| invalid())?;
        Ipv4Subnet::new(network, prefix)
    }
}

impl fmt::Display for Ipv4Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// How a runner's bridge is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BridgeConfig {
    /// The bridge's name: 1-8 of a-z 0-9, starting with a letter. One
    /// bridge per runner; two runners on one host need two names (and two
    /// subnets).
    pub bridge: String,
    pub subnet: Ipv4Subnet,
    /// The runner's directory for network state: leases in `leases/`.
    /// Must be persistent (not tmpfs) and belong to this bridge alone.
    pub state_dir: PathBuf,
    /// MTU of the bridge and every veth; `None` = the MTU of the host's
    /// default route interface (a sandbox with a larger MTU than the
    /// host's uplink depends on path-MTU discovery, which firewalls
    /// commonly break), or [`MTU_FALLBACK`].
    pub mtu: Option<u32>,
    /// The host file each sandbox's `/etc/resolv.conf` is derived from
    /// (see [`sandbox_resolv_conf`]).
    pub resolv_conf: PathBuf,
    /// TCP ports of the host no sandbox on the bridge may connect to, on
    /// any of the host's addresses: the runner's own data listener, which
    /// must be reachable by servers and so listens on an address sandboxes
    /// can route to (the host is theirs to reach otherwise).
    pub closed_host_ports: Vec<u16>,
}

impl BridgeConfig {
    /// The defaults: [`DEFAULT_BRIDGE`] on [`DEFAULT_SUBNET`], the host's
    /// resolv.conf, the MTU of the default route.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        BridgeConfig {
            bridge: DEFAULT_BRIDGE.to_owned(),
            subnet: Ipv4Subnet {
                network: Ipv4Addr::new(10, 88, 0, 0),
                prefix: 16,
            },
            state_dir: state_dir.into(),
            mtu: None,
            resolv_conf: PathBuf::from(DEFAULT_RESOLV_CONF),
            closed_host_ports: Vec::new(),
        }
    }

    fn validate(&self) -> Result<()> {
        let name = &self.bridge;
        if name.is_empty()
            || name.len() > BRIDGE_NAME_BYTES_MAX
            || !name.starts_with(|c: char| c.is_ascii_lowercase())
            || !name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        {
            return Err(Error::Invalid(format!(
                "bridge name {name:?}: use 1-{BRIDGE_NAME_BYTES_MAX} of a-z 0-9, starting with a letter"
            )));
        }
        if !self.state_dir.is_absolute() {
            return Err(Error::Invalid(format!(
                "network state directory {} must be absolute",
                self.state_dir.display()
            )));
        }
        if let Some(mtu) = self.mtu
            && !(MTU_MIN..=MTU_MAX).contains(&mtu)
        {
            return Err(Error::Invalid(format!(
                "mtu {mtu}: use {MTU_MIN}-{MTU_MAX}"
            )));
        }
        Ok(())
    }
}

/// A sandbox's address on the bridge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub sandbox: SandboxId,
    pub address: Ipv4Addr,
    pub subnet: Ipv4Subnet,
    /// The host end of the sandbox's veth pair, a port of the bridge.
    pub host_interface: String,
}

impl Lease {
    pub fn gateway(&self) -> Ipv4Addr {
        self.subnet.gateway()
    }
}

/// The network namespace a `bridge` sandbox runs in, by name.
pub fn netns_name(id: &SandboxId) -> String {
    format!("roost-{id}")
}

/// Where that namespace is bind-mounted: the path the OCI config joins.
pub fn netns_path(id: &SandboxId) -> PathBuf {
    Path::new(NETNS_DIR).join(netns_name(id))
}

/// A runner's bridge network. Cheap to clone; holds no state but its
/// configuration (the leases are on disk).
#[derive(Clone, Debug)]
pub struct BridgeNetwork {
    config: BridgeConfig,
}

impl BridgeNetwork {
    /// Checks the configuration; touches nothing.
    pub fn new(config: BridgeConfig) -> Result<Self> {
        config.validate()?;
        Ok(BridgeNetwork { config })
    }

    pub fn config(&self) -> &BridgeConfig {
        &self.config
    }

    fn bridge(&self) -> &str {
        &self.config.bridge
    }

    fn forward_chain(&self) -> String {
        format!("ROOST-FWD-{}", self.bridge())
    }

    fn nat_chain(&self) -> String {
        format!("ROOST-NAT-{}", self.bridge())
    }

    fn input_chain(&self) -> String {
        format!("ROOST-IN-{}", self.bridge())
    }

    fn leases_dir(&self) -> PathBuf {
        self.config.state_dir.join("leases")
    }

    /// The host end of the veth of the sandbox at `address`.
    pub fn host_interface(&self, address: Ipv4Addr) -> Option<String> {
        let offset = self.config.subnet.offset(address)?;
        Some(format!("{}-{offset:x}", self.bridge()))
    }

    /// Makes the host ready, idempotently: the bridge with its address and
    /// MTU, IPv6 off on it, IPv4 forwarding on (host-wide, as every
    /// container bridge needs), and the firewall chains (replaced
    /// atomically with `iptables-restore`) with one jump each from
    /// `FORWARD` and `POSTROUTING`. Success means this host enforces
    /// everything in the module docs; a missing tool is
    /// [`Error::Unsupported`] naming it.
    pub fn setup(&self) -> Result<()> {
        let _serial = SETUP_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let path = std::env::var_os("PATH").unwrap_or_default();
        for (tool, package) in [
            ("ip", "iproute2"),
            ("iptables", "iptables"),
            ("iptables-restore", "iptables"),
        ] {
            if find_binary(&path, tool).is_none() {
                return Err(Error::Unsupported(format!(
                    "network bridge needs `{tool}` on PATH: install {package}"
                )));
            }
        }
        self.ensure_bridge_device()?;
        disable_ipv6(self.bridge())?;
        enable_ipv4_forwarding()?;
        self.ensure_firewall()
    }

    fn ensure_bridge_device(&self) -> Result<()> {
        let bridge = self.bridge();
        let device = sys_class_net(bridge);
        if !device.exists() {
            // A fixed, locally administered MAC: a bridge without one takes
            // the lowest MAC of its ports, so the sandboxes' gateway would
            // change hardware address whenever a sandbox comes or goes.
            let [_, b, c, d] = self.config.subnet.gateway().octets();
            let mac = format!("02:72:6f:{b:02x}:{c:02x}:{d:02x}");
            let created = run(
                &format!("create the bridge {bridge}"),
                "ip",
                &["link", "add", bridge, "address", &mac, "type", "bridge"],
                None,
            );
            // Another runner process may have made it in the meantime.
            if let Err(e) = created
                && !device.exists()
            {
                return Err(e);
            }
        }
        if !device.join("bridge").exists() {
            return Err(Error::Unsupported(format!(
                "network interface {bridge} exists on this host and is not a bridge: choose another bridge name"
            )));
        }
        let mtu = self.config.mtu.unwrap_or_else(default_route_mtu);
        let gateway = format!(
            "{}/{}",
            self.config.subnet.gateway(),
            self.config.subnet.prefix()
        );
        let mut batch = Vec::new();
        if read_trimmed(&device.join("mtu")) != mtu.to_string() {
            batch.push(format!("link set dev {bridge} mtu {mtu}"));
        }
        let addresses = run(
            &format!("list the addresses of {bridge}"),
            "ip",
            &["-o", "-4", "address", "show", "dev", bridge],
            None,
        )?;
        if !addresses
            .split_whitespace()
            .any(|word| word == gateway.as_str())
        {
            batch.push(format!("address add {gateway} dev {bridge}"));
        }
        // IFF_UP is bit 0 of the interface flags.
        let flags = read_trimmed(&device.join("flags"));
        let up = u32::from_str_radix(flags.trim_start_matches("0x"), 16).is_ok_and(|f| f & 1 == 1);
        if !up {
            batch.push(format!("link set dev {bridge} up"));
        }
        if !batch.is_empty() {
            ip_batch(&format!("configure the bridge {bridge}"), None, &batch)?;
        }
        Ok(())
    }

    /// The rules, as one `iptables-restore --noflush` input: declaring a
    /// chain flushes it, so loading this again replaces the chains'
    /// contents in one transaction, never duplicating or half-loading.
    fn firewall_rules(&self) -> String {
        let bridge = self.bridge();
        let forward = self.forward_chain();
        let nat = self.nat_chain();
        let input = self.input_chain();
        let subnet = self.config.subnet;
        let mut rules = format!("*filter\n:{forward} - [0:0]\n:{input} - [0:0]\n");
        // The host's own services a sandbox must not reach: a connection
        // the sandbox opens is refused at once (a client there fails fast);
        // replies to the host's own connections into the sandbox pass,
        // whatever port the host happened to send from.
        for port in &self.config.closed_host_ports {
            rules += &format!(
                "-A {input} -i {bridge} -p tcp --dport {port} -m conntrack --ctstate NEW -j REJECT --reject-with tcp-reset\n"
            );
        }
        // Sandbox to sandbox through the host (and bridged frames, when
        // br_netfilter passes them to iptables).
        rules += &format!("-A {forward} -i {bridge} -o {bridge} -j DROP\n");
        for destination in BLOCKED_DESTINATIONS {
            rules += &format!("-A {forward} -i {bridge} -d {destination} -j DROP\n");
        }
        rules += &format!("-A {forward} -i {bridge} -j ACCEPT\n");
        rules += &format!(
            "-A {forward} -o {bridge} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n"
        );
        rules += &format!("-A {forward} -o {bridge} -j DROP\n");
        rules += "COMMIT\n";
        rules += &format!("*nat\n:{nat} - [0:0]\n");
        rules += &format!("-A {nat} -s {subnet} ! -o {bridge} -j MASQUERADE\n");
        rules += "COMMIT\n";
        rules
    }

    fn ensure_firewall(&self) -> Result<()> {
        let bridge = self.bridge();
        run(
            &format!("load the firewall rules of bridge {bridge}"),
            "iptables-restore",
            &["-w", "--noflush"],
            Some(&self.firewall_rules()),
        )?;
        for (table, chain, target) in self.jumps() {
            let check = ["-w", "-t", table, "-C", chain, "-j", &target];
            if run("", "iptables", &check, None).is_err() {
                run(
                    &format!("send {chain} traffic of bridge {bridge} to {target}"),
                    "iptables",
                    &["-w", "-t", table, "-I", chain, "1", "-j", &target],
                    None,
                )?;
            }
        }
        Ok(())
    }

    fn jumps(&self) -> [(&'static str, &'static str, String); 3] {
        [
            ("filter", "FORWARD", self.forward_chain()),
            ("filter", "INPUT", self.input_chain()),
            ("nat", "POSTROUTING", self.nat_chain()),
        ]
    }

    /// Removes what [`BridgeNetwork::setup`] made: the jumps, the chains,
    /// the bridge. Leases stay (they are the sandboxes'), IPv4 forwarding
    /// stays on (other things on the host may rely on it). For operators
    /// retiring a bridge after its sandboxes are deleted.
    pub fn teardown(&self) -> Result<()> {
        let _serial = SETUP_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let bridge = self.bridge();
        for (table, chain, target) in self.jumps() {
            while run(
                "",
                "iptables",
                &["-w", "-t", table, "-C", chain, "-j", &target],
                None,
            )
            .is_ok()
            {
                run(
                    &format!("remove the jump from {chain} to {target}"),
                    "iptables",
                    &["-w", "-t", table, "-D", chain, "-j", &target],
                    None,
                )?;
            }
            if run("", "iptables", &["-w", "-t", table, "-S", &target], None).is_ok() {
                for op in ["-F", "-X"] {
                    run(
                        &format!("remove the chain {target}"),
                        "iptables",
                        &["-w", "-t", table, op, &target],
                        None,
                    )?;
                }
            }
        }
        delete_link(bridge)
    }

    /// Gives sandbox `id` its network: a lease, the namespace
    /// [`netns_path`] with `lo` and `eth0` (address, default route via the
    /// bridge), the host end on the bridge as an isolated port, and
    /// `paths.resolv_conf()`. Repairs a bridge that has vanished. Whatever
    /// an earlier, interrupted attach of the same sandbox left is replaced;
    /// a failure undoes this one.
    pub fn attach(&self, id: &SandboxId, paths: &SandboxPaths) -> Result<Lease> {
        if !sys_class_net(self.bridge()).join("bridge").exists() {
            self.setup()?;
        }
        let lease = self.lease_for(id)?;
        let result = self
            .write_resolv_conf(id, &paths.resolv_conf())
            .and_then(|()| self.plumb(&lease));
        if let Err(e) = result {
            // Best effort: the error worth reporting is the first one, and
            // anything left is removed by the next attach or a delete.
            let _ = self.detach(id);
            return Err(e);
        }
        Ok(lease)
    }

    fn plumb(&self, lease: &Lease) -> Result<()> {
        let id = &lease.sandbox;
        let veth = &lease.host_interface;
        let netns = netns_name(id);
        let bridge = self.bridge();
        // Leftovers of an interrupted attempt: same names, so remove them.
        delete_link(veth)?;
        delete_netns(id)?;
        let mtu = read_trimmed(&sys_class_net(bridge).join("mtu"))
            .parse::<u32>()
            .unwrap_or(MTU_FALLBACK);
        let action = format!("set up the network of sandbox {id}");
        let address = lease.address;
        ip_batch(
            &action,
            None,
            &[
                // The host may still map this address to the veth of the
                // sandbox that had it last (leases are reused): it would
                // send there, not here, until the entry went stale, and a
                // connection the host opens to a new sandbox failed for
                // seconds. Forgotten, it is learnt again from this one.
                format!("neigh flush to {address} dev {bridge}"),
                format!("netns add {netns}"),
                format!(
                    "link add {veth} mtu {mtu} type veth peer name {SANDBOX_INTERFACE} mtu {mtu} netns {netns}"
                ),
                format!("link set dev {veth} master {bridge}"),
                format!("link set dev {veth} type bridge_slave isolated on"),
                format!("link set dev {veth} up"),
            ],
        )?;
        disable_ipv6(veth)?;
        let gateway = lease.gateway();
        let prefix = lease.subnet.prefix();
        ip_batch(
            &action,
            Some(&netns),
            &[
                "link set dev lo up".to_owned(),
                format!("link set dev {SANDBOX_INTERFACE} addrgenmode none"),
                format!("address add {address}/{prefix} dev {SANDBOX_INTERFACE}"),
                format!("link set dev {SANDBOX_INTERFACE} up"),
                format!("route add default via {gateway} dev {SANDBOX_INTERFACE}"),
            ],
        )
    }

    fn write_resolv_conf(&self, id: &SandboxId, target: &Path) -> Result<()> {
        let source = &self.config.resolv_conf;
        let host = std::fs::read_to_string(source).unwrap_or_default();
        let fallback = std::fs::read_to_string(RESOLVED_UPSTREAM_CONF).ok();
        let mut text = format!(
            "# written by roost for sandbox {id} from {}\n",
            source.display()
        );
        text += &sandbox_resolv_conf(&host, fallback.as_deref());
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| Error::io("create directory", parent, e))?;
        }
        write_file(target, text.as_bytes())
    }

    /// Takes sandbox `id` off the bridge: removes its veth, its namespace
    /// and then its lease. Idempotent; nothing to do for a sandbox that
    /// never had one.
    pub fn detach(&self, id: &SandboxId) -> Result<()> {
        let leases = self.leases_of(id)?;
        for lease in &leases {
            delete_link(&lease.host_interface)?;
        }
        delete_netns(id)?;
        if leases.is_empty() {
            return Ok(());
        }
        let dir = self.leases_dir();
        for lease in &leases {
            let path = dir.join(lease.address.to_string());
            // Only this sandbox's detach removes its lease, so nobody can
            // have replaced it since it was read.
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("release the address lease", &path, e)),
            }
        }
        sync_dir(&dir)
    }

    /// The sandbox's lease, if it has one.
    pub fn lease(&self, id: &SandboxId) -> Result<Option<Lease>> {
        Ok(self.leases_of(id)?.into_iter().next())
    }

    fn leases_of(&self, id: &SandboxId) -> Result<Vec<Lease>> {
        let mut leases = self.leases()?;
        leases.retain(|lease| lease.sandbox == *id);
        Ok(leases)
    }

    /// Every lease, by address. Entries that are not leases of this subnet
    /// are ignored. A runner that finds leases of sandboxes it no longer
    /// has (the host rebooted and lost them) frees them with
    /// [`BridgeNetwork::detach`].
    pub fn leases(&self) -> Result<Vec<Lease>> {
        let dir = self.leases_dir();
        let listing = match std::fs::read_dir(&dir) {
            Ok(listing) => listing,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("list", &dir, e)),
        };
        let subnet = self.config.subnet;
        let mut leases = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
            let Some(address) = entry
                .file_name()
                .to_str()
                .and_then(|name| name.parse::<Ipv4Addr>().ok())
            else {
                continue;
            };
            let Some(offset) = subnet.offset(address) else {
                continue;
            };
            if !subnet.sandbox_offsets().contains(&offset) {
                continue;
            }
            let target = match std::fs::read_link(entry.path()) {
                Ok(target) => target,
                // Released meanwhile.
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                // Not a symlink: not a lease.
                Err(e) if e.kind() == ErrorKind::InvalidInput => continue,
                Err(e) => return Err(Error::io("read the address lease", entry.path(), e)),
            };
            let Some(sandbox) = target.to_str().and_then(|t| SandboxId::new(t).ok()) else {
                continue;
            };
            let Some(host_interface) = self.host_interface(address) else {
                continue;
            };
            leases.push(Lease {
                sandbox,
                address,
                subnet,
                host_interface,
            });
        }
        leases.sort_by_key(|lease| lease.address);
        Ok(leases)
    }

    /// The sandbox's existing lease, or the lowest free address.
    fn lease_for(&self, id: &SandboxId) -> Result<Lease> {
        let leases = self.leases()?;
        if let Some(lease) = leases.iter().find(|lease| lease.sandbox == *id) {
            return Ok(lease.clone());
        }
        let subnet = self.config.subnet;
        let dir = self.leases_dir();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        let taken: BTreeSet<Ipv4Addr> = leases.iter().map(|lease| lease.address).collect();
        for offset in subnet.sandbox_offsets() {
            let address = subnet.address(offset);
            if taken.contains(&address) {
                continue;
            }
            let path = dir.join(address.to_string());
            match std::os::unix::fs::symlink(id.as_str(), &path) {
                Ok(()) => {
                    sync_dir(&dir)?;
                    let host_interface = self.host_interface(address).ok_or_else(|| {
                        Error::Invalid(format!("address {address} outside subnet {subnet}"))
                    })?;
                    return Ok(Lease {
                        sandbox: id.clone(),
                        address,
                        subnet,
                        host_interface,
                    });
                }
                // Taken since the listing: try the next one.
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io("write the address lease", &path, e)),
            }
        }
        Err(Error::AddressesExhausted {
            subnet: subnet.to_string(),
            leases: taken.len(),
        })
    }
}

/// A sandbox's resolv.conf from the host's `host` text: `nameserver` lines
/// the sandbox cannot use are dropped (loopback ones, a local stub such as
/// systemd-resolved's 127.0.0.53, are the host's own; IPv6 ones, because a
/// sandbox has no IPv6). When none remain, the nameservers of `fallback`
/// (systemd-resolved's upstream list) are used. `search`, `domain` and
/// `options` lines are kept. With no usable nameserver at all the result
/// has none, and lookups in the sandbox fail rather than go somewhere
/// unexpected.
pub fn sandbox_resolv_conf(host: &str, fallback: Option<&str>) -> String {
    fn usable_nameserver(line: &str) -> Option<Ipv4Addr> {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            return None;
        }
        let address: Ipv4Addr = words.next()?.parse().ok()?;
        (!address.is_loopback() && !address.is_unspecified()).then_some(address)
    }
    let nameservers =
        |text: &str| -> Vec<Ipv4Addr> { text.lines().filter_map(usable_nameserver).collect() };
    let mut servers = nameservers(host);
    if servers.is_empty() {
        servers = fallback.map(nameservers).unwrap_or_default();
    }
    let mut text = String::new();
    for server in servers {
        text += &format!("nameserver {server}\n");
    }
    for line in host.lines() {
        let keyword = line.split_whitespace().next().unwrap_or_default();
        if matches!(keyword, "search" | "domain" | "options") {
            text += line.trim();
            text += "\n";
        }
    }
    text
}

fn sys_class_net(name: &str) -> PathBuf {
    Path::new("/sys/class/net").join(name)
}

fn read_trimmed(path: &Path) -> String {
    std::fs::read_to_string(path)
        .map(|text| text.trim().to_owned())
        .unwrap_or_default()
}

/// The smallest MTU among the interfaces of the host's IPv4 default routes.
fn default_route_mtu() -> u32 {
    let Ok(routes) = run("", "ip", &["-o", "-4", "route", "show", "default"], None) else {
        return MTU_FALLBACK;
    };
    routes
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|word| *word == "dev")?;
            let device = words.next()?;
            read_trimmed(&sys_class_net(device).join("mtu"))
                .parse()
                .ok()
        })
        .filter(|mtu| (MTU_MIN..=MTU_MAX).contains(mtu))
        .min()
        .unwrap_or(MTU_FALLBACK)
}

/// IPv6 off on a host interface, where the kernel has IPv6 at all.
fn disable_ipv6(interface: &str) -> Result<()> {
    let path = Path::new("/proc/sys/net/ipv6/conf")
        .join(interface)
        .join("disable_ipv6");
    if !path.exists() || read_trimmed(&path) == "1" {
        return Ok(());
    }
    std::fs::write(&path, "1").map_err(|e| Error::io("write", &path, e))
}

fn enable_ipv4_forwarding() -> Result<()> {
    let path = Path::new("/proc/sys/net/ipv4/ip_forward");
    if read_trimmed(path) == "1" {
        return Ok(());
    }
    std::fs::write(path, "1").map_err(|e| Error::io("enable IPv4 forwarding in", path, e))
}

/// `ip link del`, unless the interface is gone already (or goes while
/// this runs: deleting either end of a veth pair deletes both).
fn delete_link(name: &str) -> Result<()> {
    if !sys_class_net(name).exists() {
        return Ok(());
    }
    match run(
        &format!("delete the interface {name}"),
        "ip",
        &["link", "del", "dev", name],
        None,
    ) {
        Ok(_) => Ok(()),
        Err(_) if !sys_class_net(name).exists() => Ok(()),
        Err(e) => Err(e),
    }
}

/// `ip netns del`, unless the namespace is gone already. The namespace
/// itself lives on until its last process has ended; only its name goes.
fn delete_netns(id: &SandboxId) -> Result<()> {
    let path = netns_path(id);
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(());
    }
    let name = netns_name(id);
    match run(
        &format!("delete the network namespace of sandbox {id}"),
        "ip",
        &["netns", "del", &name],
        None,
    ) {
        Ok(_) => Ok(()),
        Err(_) if std::fs::symlink_metadata(&path).is_err() => Ok(()),
        Err(e) => Err(e),
    }
}

/// `ip [-n NETNS] -batch -` with `lines`; a failure names the line that
/// failed (`ip` stops there).
fn ip_batch(action: &str, netns: Option<&str>, lines: &[String]) -> Result<()> {
    let mut args = Vec::new();
    if let Some(netns) = netns {
        args.extend(["-n", netns]);
    }
    args.extend(["-batch", "-"]);
    let mut input = lines.join("\n");
    input.push('\n');
    match run(action, "ip", &args, Some(&input)) {
        Ok(_) => Ok(()),
        Err(Error::Network {
            action,
            command,
            status,
            message,
        }) => {
            // `ip` reports "Command failed -:N" for the N-th line.
            let failed = message
                .lines()
                .find_map(|line| line.trim().strip_prefix("Command failed -:"))
                .and_then(|n| n.trim().parse::<usize>().ok())
                .and_then(|n| lines.get(n.checked_sub(1)?));
            let command = match failed {
                Some(line) => format!("{command}: {line}"),
                None => command,
            };
            let message = message
                .lines()
                .filter(|line| !line.starts_with("Command failed"))
                .collect::<Vec<_>>()
                .join("; ");
            Err(Error::Network {
                action,
                command,
                status,
                message,
            })
        }
        Err(e) => Err(e),
    }
}

/// Runs `program args…` (with `stdin`, if any) through the host's tool
/// runner and returns its stdout. A failure is [`Error::Network`] naming
/// `action`, the command line and what the program said on stderr.
fn run(action: &str, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
    run_tool(program, args, stdin).map_err(|failure| {
        let (status, message) = match &failure.kind {
            ToolFailureKind::Run { step, source } => (None, format!("could not {step}: {source}")),
            ToolFailureKind::Exited { status, .. } => (*status, failure.said("\n")),
        };
        Error::Network {
            action: action.to_owned(),
            command: failure.command,
            status,
            message,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnets() {
        let subnet: Ipv4Subnet = "10.88.0.0/16".parse().expect("valid");
        assert_eq!(subnet.gateway(), Ipv4Addr::new(10, 88, 0, 1));
        assert_eq!(subnet.to_string(), "10.88.0.0/16");
        assert!(subnet.contains(Ipv4Addr::new(10, 88, 255, 255)));
        assert!(!subnet.contains(Ipv4Addr::new(10, 89, 0, 1)));
        assert_eq!(subnet.sandbox_offsets(), 2..=65_534);
        let small: Ipv4Subnet = "192.168.7.0/30".parse().expect("valid");
        assert_eq!(small.sandbox_offsets(), 2..=2);
        for bad in [
            "10.88.0.1/16",
            "10.88.0.0/31",
            "10.0.0.0/7",
            "10.88.0.0",
            "x/16",
            "10.88.0.0/abc",
        ] {
            assert!(bad.parse::<Ipv4Subnet>().is_err(), "{bad}");
        }
    }

    #[test]
    fn configs() {
        let config = BridgeConfig::new("/var/lib/roost/network");
        assert!(config.validate().is_ok());
        assert_eq!(config.subnet.to_string(), DEFAULT_SUBNET);
        for bad in ["", "Roost0", "0roost", "roost-0", "roostroost"] {
            let mut config = config.clone();
            config.bridge = bad.to_owned();
            assert!(config.validate().is_err(), "{bad}");
        }
        let mut relative = config.clone();
        relative.state_dir = "network".into();
        assert!(relative.validate().is_err());
        let mut mtu = config.clone();
        mtu.mtu = Some(100);
        assert!(mtu.validate().is_err());
    }

    #[test]
    fn names_fit_the_kernel_limits() {
        let mut config = BridgeConfig::new("/x");
        config.bridge = "abcdefgh".to_owned();
        config.subnet = "10.0.0.0/8".parse().expect("valid");
        let network = BridgeNetwork::new(config).expect("valid");
        let last = network
            .host_interface(Ipv4Addr::new(10, 255, 255, 254))
            .expect("in subnet");
        assert_eq!(last, "abcdefgh-fffffe");
        assert!(last.len() <= 15, "{last}");
        assert!(network.host_interface(Ipv4Addr::new(11, 0, 0, 1)).is_none());
        assert!(network.forward_chain().len() <= 28);
        let id = SandboxId::new("sbx_1").expect("valid");
        assert_eq!(netns_path(&id), Path::new("/run/netns/roost-sbx_1"));
    }

    #[test]
    fn resolv_conf_keeps_what_a_sandbox_can_use() {
        let host = "# comment\nnameserver 127.0.0.53\nnameserver 192.0.2.53\n\
                    nameserver fd00::53\nsearch corp.example\noptions edns0 trust-ad\n";
        assert_eq!(
            sandbox_resolv_conf(host, None),
            "nameserver 192.0.2.53\nsearch corp.example\noptions edns0 trust-ad\n"
        );
        // Only a local stub: systemd-resolved's upstreams instead.
        let stub = "nameserver 127.0.0.53\noptions edns0\n";
        let upstream = "nameserver 198.51.100.53\nnameserver 198.51.100.54\n";
        assert_eq!(
            sandbox_resolv_conf(stub, Some(upstream)),
            "nameserver 198.51.100.53\nnameserver 198.51.100.54\noptions edns0\n"
        );
        assert_eq!(sandbox_resolv_conf(stub, None), "options edns0\n");
        assert_eq!(sandbox_resolv_conf("", None), "");
    }

    #[test]
    fn firewall_rules_isolate_and_masquerade() {
        let mut config = BridgeConfig::new("/x");
        config.bridge = "rb0".to_owned();
        config.subnet = "10.9.0.0/24".parse().expect("valid");
        config.closed_host_ports = vec![7071];
        let rules = BridgeNetwork::new(config).expect("valid").firewall_rules();
        let expected = "*filter\n:ROOST-FWD-rb0 - [0:0]\n:ROOST-IN-rb0 - [0:0]\n\
            -A ROOST-IN-rb0 -i rb0 -p tcp --dport 7071 -m conntrack --ctstate NEW -j REJECT --reject-with tcp-reset\n\
            -A ROOST-FWD-rb0 -i rb0 -o rb0 -j DROP\n\
            -A ROOST-FWD-rb0 -i rb0 -d 169.254.0.0/16 -j DROP\n\
            -A ROOST-FWD-rb0 -i rb0 -j ACCEPT\n\
            -A ROOST-FWD-rb0 -o rb0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
            -A ROOST-FWD-rb0 -o rb0 -j DROP\n\
            COMMIT\n\
            *nat\n:ROOST-NAT-rb0 - [0:0]\n\
            -A ROOST-NAT-rb0 -s 10.9.0.0/24 ! -o rb0 -j MASQUERADE\n\
            COMMIT\n";
        assert_eq!(rules, expected);
    }

    fn network_in(dir: &Path, subnet: &str) -> BridgeNetwork {
        let mut config = BridgeConfig::new(dir);
        config.subnet = subnet.parse().expect("valid");
        BridgeNetwork::new(config).expect("valid")
    }

    #[test]
    fn leases_are_distinct_reused_released_and_kept_on_disk() {
        let dir = tempfile::tempdir().expect("temp dir");
        let id = |s: &str| SandboxId::new(s).expect("valid");
        let network = network_in(dir.path(), "10.9.0.0/29");
        let a = network.lease_for(&id("a")).expect("lease a");
        let b = network.lease_for(&id("b")).expect("lease b");
        assert_eq!(a.address, Ipv4Addr::new(10, 9, 0, 2));
        assert_eq!(b.address, Ipv4Addr::new(10, 9, 0, 3));
        assert_eq!(a.host_interface, "roost0-2");
        // Asking again (a retried attach) gives the same lease.
        assert_eq!(network.lease_for(&id("a")).expect("again"), a);

        // A new instance (a restarted runner) sees the same leases.
        let restarted = network_in(dir.path(), "10.9.0.0/29");
        assert_eq!(restarted.lease(&id("b")).expect("read"), Some(b.clone()));
        let c = restarted.lease_for(&id("c")).expect("lease c");
        assert_eq!(c.address, Ipv4Addr::new(10, 9, 0, 4));

        // Junk in the directory is not a lease and blocks nothing.
        std::fs::write(dir.path().join("leases/10.9.0.5"), "x").expect("junk");
        std::fs::write(dir.path().join("leases/notes"), "x").expect("junk");
        assert_eq!(restarted.leases().expect("list").len(), 3);

        // Released (nothing was plumbed, so only the lease goes) and
        // reused lowest-first.
        restarted.detach(&id("a")).expect("detach");
        assert_eq!(restarted.lease(&id("a")).expect("read"), None);
        restarted.detach(&id("a")).expect("idempotent");
        let d = restarted.lease_for(&id("d")).expect("lease d");
        assert_eq!(d.address, a.address);

        // .2 .3 .4 taken, .5 blocked by the junk file, .6 free, then none.
        let e = restarted.lease_for(&id("e")).expect("lease e");
        assert_eq!(e.address, Ipv4Addr::new(10, 9, 0, 6));
        let full = restarted.lease_for(&id("f")).expect_err("exhausted");
        assert!(
            matches!(full, Error::AddressesExhausted { leases: 4, .. }),
            "{full}"
        );
        assert!(full.to_string().contains("10.9.0.0/29"), "{full}");
    }
}
