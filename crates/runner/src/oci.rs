//! The OCI runtime configuration (`config.json`) of a sandbox, generated in
//! code with `oci-spec`, and the host-side root directory it points at.
//!
//! # The default image: the host's own system
//!
//! ```text
//! container path      what it is
//! /                   DIR/rootfs on the host: a plain, writable directory that
//!                     belongs to this sandbox. Whatever the sandbox writes at
//!                     its top level (/opt/x, /var/cache/y) lands here, on this
//!                     node: the node-bound `standard` storage. Nothing of the
//!                     host is writable through it.
//! /usr /etc           the host's directories, bind-mounted read-only (nosuid,
//! /lib* /bin /sbin    nodev); where the host has merged-/usr symlinks
//!                     (/bin -> usr/bin) the same symlinks are made in rootfs
//! /workspace          the caller's host directory, read-write: $HOME and the
//!                     default cwd
//! /tmp /run           fresh tmpfs (charged to the memory cgroup)
//! /proc /sys /dev     proc; sysfs read-only; tmpfs /dev with the standard
//!                     devices the runtime creates, devpts, a 64 MiB /dev/shm,
//!                     mqueue; /sys/fs/cgroup read-only in its own cgroup ns
//! /.roost/init        the init binary, bind-mounted read-only
//! ```
//!
//! So the root is read-only for everything that comes from the host and
//! writable only in the sandbox's own layer. Host secrets that the read-only
//! `/etc` would otherwise show (shadow files, SSH host keys, whatever the
//! caller adds, such as the runner's own configuration) are masked, like
//! Docker's masked `/proc` entries.
//!
//! # Isolation
//!
//! Namespaces: pid, mount, ipc, uts, cgroup and network (`none`: a fresh
//! namespace with only loopback; `bridge`: the named namespace that
//! [`crate::network`] plumbed before `create`, joined by path, with the
//! sandbox's own `/etc/resolv.conf` mounted read-only over the host's).
//! Capabilities: Docker's default set minus `CAP_NET_RAW` (see
//! [`CAPABILITIES`]); none inheritable or ambient.
//! `noNewPrivileges`. A seccomp filter (see [`seccomp`]). Cgroup limits for
//! memory (swap disabled where the host accounts swap), CPU quota and pids;
//! device access denied except the runtime's standard devices.
//!
//! There is no user namespace yet: root in the sandbox is root on the host
//! minus capabilities, seccomp and the mounts above. That is Docker's
//! default posture; a user namespace is the next step up.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    Arch, Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder,
    LinuxDeviceCgroupBuilder, LinuxMemoryBuilder, LinuxNamespaceBuilder, LinuxNamespaceType,
    LinuxPidsBuilder, LinuxResourcesBuilder, LinuxSeccomp, LinuxSeccompAction,
    LinuxSeccompArgBuilder, LinuxSeccompBuilder, LinuxSeccompOperator, LinuxSyscall,
    LinuxSyscallBuilder, Mount, MountBuilder, PosixRlimitBuilder, PosixRlimitType, Process,
    ProcessBuilder, RootBuilder, Spec, SpecBuilder, UserBuilder,
};

use crate::config::{CPU_PERIOD_US, Network, RootImage, SandboxConfig, SandboxPaths};
use crate::error::{Error, Result};

/// Where the init binary appears inside every sandbox.
pub const INIT_PATH: &str = "/.roost/init";
/// The host's dynamic loader, for the init inside an imported image.
pub const INIT_LOADER_PATH: &str = "/.roost/ld.so";
/// The host libraries the init links against, one bind mount each.
pub const INIT_LIBS_PATH: &str = "/.roost/lib";
/// The sandbox's home: `$HOME`, the default cwd, the caller's host directory.
pub const WORKSPACE_PATH: &str = "/workspace";
/// A `bridge` sandbox's DNS configuration (see [`SandboxPaths::resolv_conf`]).
///
/// [`SandboxPaths::resolv_conf`]: crate::SandboxPaths::resolv_conf
pub const RESOLV_CONF_PATH: &str = "/etc/resolv.conf";
/// `PATH` of the init, the workload and commands unless overridden.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Docker's default capability set without `CAP_NET_RAW` (raw sockets
/// forge packets, which `bridge` isolation relies on no sandbox doing; and
/// `ping` uses ICMP datagram sockets). No `CAP_NET_ADMIN` either: a
/// sandbox cannot change its addresses, routes or interfaces. Bounding,
/// effective and permitted get exactly these; inheritable and ambient
/// stay empty, so a program cannot carry them through `execve` of a
/// non-root binary (CVE-2022-24769).
pub const CAPABILITIES: &[Capability] = &[
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fsetid,
    Capability::Fowner,
    Capability::Mknod,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setfcap,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::SysChroot,
    Capability::Kill,
    Capability::AuditWrite,
];

/// Paths hidden inside every sandbox: Docker's masked `/proc` and `/sys`
/// entries (kernel memory, keys, timers, firmware), and the host secrets the
/// read-only `/etc` would otherwise expose. SSH host keys are found on the
/// host and added (see [`HostSystem::probe`]). Paths missing on a host are
/// skipped by the runtime.
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/sys/devices/virtual/powercap",
    "/sys/firmware",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/shadow",
    "/etc/shadow-",
];

/// Kernel knobs visible but read-only, as in Docker.
pub const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// Open files per process: the usual soft limit (programs using `select`
/// keep working) and a hard limit high enough for build tools, which raise
/// their soft limit themselves; both capped at the runner's own hard limit
/// ([`HostSystem::nofile_hard_max`]).
pub const NOFILE_SOFT: u64 = 1024;
pub const NOFILE_HARD: u64 = 524_288;

/// `EPERM`: what a denied syscall returns, as if the capability it needs
/// were missing; programs handle that gracefully.
const EPERM: u32 = 1;
/// `ENOSYS`: for `clone3` only, so libc falls back to `clone`, whose flags
/// the filter can inspect.
const ENOSYS: u32 = 38;

/// Syscalls the filter refuses, by reason. The filter allows everything
/// else: an allow-list like Docker's (~350 names, kept in step with every
/// kernel release) is what a container platform owes eventually, but
/// capabilities already gate most of the kernel; this list closes what they
/// leave open and what is dangerous even where a capability would allow it,
/// following the groups of Docker's default profile.
pub const DENIED_SYSCALLS: &[(&str, &[&str])] = &[
    (
        "kernel modules and kexec load code into the shared kernel",
        &[
            "init_module",
            "finit_module",
            "delete_module",
            "create_module",
            "query_module",
            "get_kernel_syms",
            "kexec_load",
            "kexec_file_load",
        ],
    ),
    (
        "bpf and perf events are large kernel attack surfaces and observe the host",
        &["bpf", "perf_event_open", "lookup_dcookie", "fanotify_init"],
    ),
    (
        "mounting is the host's business (no CAP_SYS_ADMIN anyway)",
        &[
            "mount",
            "umount",
            "umount2",
            "pivot_root",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "move_mount",
            "open_tree",
            "mount_setattr",
        ],
    ),
    (
        "new or foreign namespaces: unprivileged user namespaces open kernel paths meant for root",
        &["unshare", "setns"],
    ),
    (
        "swap, reboot, process accounting and quotas act on the whole host",
        &["swapon", "swapoff", "reboot", "acct", "quotactl"],
    ),
    (
        "the clock is shared with the host",
        &["settimeofday", "clock_settime", "clock_adjtime", "stime"],
    ),
    (
        "file handles skip path permission checks (the 'shocker' escape)",
        &["open_by_handle_at", "name_to_handle_at"],
    ),
    (
        "the kernel keyring is not namespaced",
        &["keyctl", "add_key", "request_key"],
    ),
    (
        "userfaultfd stalls kernel code at will: a common exploit primitive",
        &["userfaultfd"],
    ),
    (
        "tracing and reading other processes' memory (also blocks strace and gdb)",
        &[
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "kcmp",
            "pidfd_getfd",
        ],
    ),
    (
        "io_uring has carried many kernel exploits and runs operations the filter never sees",
        &["io_uring_setup", "io_uring_enter", "io_uring_register"],
    ),
    (
        "raw hardware, the kernel log and obsolete interfaces",
        &[
            "iopl",
            "ioperm",
            "syslog",
            "uselib",
            "ustat",
            "sysfs",
            "_sysctl",
            "vm86",
            "vm86old",
            "nfsservctl",
            "vhangup",
        ],
    ),
];

/// `clone` flags that create namespaces; `clone` with any of them is
/// refused (as `unshare` is). Plain `fork` and thread creation pass.
const CLONE_NAMESPACE_FLAGS: &[(&str, u64)] = &[
    ("CLONE_NEWNS", 0x0002_0000),
    ("CLONE_NEWCGROUP", 0x0200_0000),
    ("CLONE_NEWUTS", 0x0400_0000),
    ("CLONE_NEWIPC", 0x0800_0000),
    ("CLONE_NEWUSER", 0x1000_0000),
    ("CLONE_NEWPID", 0x2000_0000),
    ("CLONE_NEWNET", 0x4000_0000),
];

/// One top-level entry of the host's system that the default image shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SystemEntry {
    /// A host directory, bind-mounted read-only at the same path.
    Directory(String),
    /// A host symlink such as `/bin -> usr/bin`, recreated in the rootfs.
    Symlink { path: String, target: PathBuf },
}

/// What the default image takes from the host, probed once per runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostSystem {
    pub entries: Vec<SystemEntry>,
    /// Extra paths to mask: the host's SSH private host keys.
    pub secret_paths: Vec<String>,
    /// Whether the memory cgroup accounts swap; only then can the config
    /// pin swap to zero (`memory.swap` = `memory.limit`).
    pub swap_accounting: bool,
    /// The runner's own hard limit on open files. The sandbox's cannot be
    /// higher unless the runner holds CAP_SYS_RESOURCE, so it is capped
    /// here rather than failing every create.
    pub nofile_hard_max: u64,
}

impl HostSystem {
    /// Reads `/` for `usr`, `etc`, `bin`, `sbin` and `lib*`, and `/etc/ssh`
    /// for `ssh_host_*_key` files.
    pub fn probe(swap_accounting: bool) -> Result<Self> {
        let mut entries = Vec::new();
        let root = Path::new("/");
        let listing = std::fs::read_dir(root).map_err(|e| Error::io("list", root, e))?;
        let mut names: Vec<String> = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| Error::io("list", root, e))?;
            if let Ok(name) = entry.file_name().into_string()
                && (matches!(name.as_str(), "usr" | "etc" | "bin" | "sbin")
                    || name.starts_with("lib"))
            {
                names.push(name);
            }
        }
        names.sort();
        for name in names {
            let path = format!("/{name}");
            let metadata =
                std::fs::symlink_metadata(&path).map_err(|e| Error::io("inspect", &path, e))?;
            if metadata.file_type().is_symlink() {
                let target = std::fs::read_link(&path).map_err(|e| Error::io("read", &path, e))?;
                entries.push(SystemEntry::Symlink { path, target });
            } else if metadata.is_dir() {
                entries.push(SystemEntry::Directory(path));
            }
        }
        for required in ["/usr", "/etc"] {
            if !entries
                .iter()
                .any(|e| matches!(e, SystemEntry::Directory(p) if p == required))
            {
                return Err(Error::Unsupported(format!(
                    "the default image needs the host directory {required}"
                )));
            }
        }
        let mut secret_paths = Vec::new();
        if let Ok(listing) = std::fs::read_dir("/etc/ssh") {
            for entry in listing.flatten() {
                if let Ok(name) = entry.file_name().into_string()
                    && name.starts_with("ssh_host_")
                    && name.ends_with("_key")
                {
                    secret_paths.push(format!("/etc/ssh/{name}"));
                }
            }
        }
        secret_paths.sort();
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        Ok(HostSystem {
            entries,
            secret_paths,
            swap_accounting,
            nofile_hard_max: nofile.maximum.unwrap_or(u64::MAX),
        })
    }
}

fn spec_error(config: &SandboxConfig) -> impl Fn(oci_spec::OciSpecError) -> Error + '_ {
    move |e| Error::Spec {
        id: config.id.to_string(),
        message: e.to_string(),
    }
}

/// The complete `config.json` of a sandbox. `cgroups_path` is the runtime's
/// cgroup path for it (see [`crate::runtime::Runtime`]).
pub fn spec(config: &SandboxConfig, host: &HostSystem, cgroups_path: &str) -> Result<Spec> {
    config.validate()?;
    let err = spec_error(config);

    let linkage = match config.image {
        RootImage::Host => None,
        RootImage::Tree(_) => init_linkage(&config.init.host_path)?,
    };
    // In an imported image the host's init binary runs through the host's
    // own dynamic loader and libraries (mounted under /.roost): the image
    // may have another C library, or none.
    let mut args = match &linkage {
        Some(_) => vec![
            INIT_LOADER_PATH.to_owned(),
            "--library-path".to_owned(),
            INIT_LIBS_PATH.to_owned(),
            INIT_PATH.to_owned(),
        ],
        None => vec![INIT_PATH.to_owned()],
    };
    args.extend(config.init.args.iter().cloned());
    if !config.workload.is_empty() {
        args.push("--".to_owned());
        args.extend(config.workload.iter().cloned());
    }
    let nofile_hard = NOFILE_HARD.min(host.nofile_hard_max);
    let process = base_process(
        args,
        environment(&config.env, &BTreeMap::new()),
        (NOFILE_SOFT.min(nofile_hard), nofile_hard),
    )
    .map_err(&err)?;

    let mut namespaces = Vec::new();
    for typ in [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Cgroup,
        LinuxNamespaceType::Network,
    ] {
        let mut namespace = LinuxNamespaceBuilder::default().typ(typ);
        // `bridge`: join the namespace crate::network prepared (whoever
        // runs `create` must have attached the sandbox first, as
        // `Runtime::create` does); `none`: the runtime makes a fresh one.
        if typ == LinuxNamespaceType::Network && config.network == Network::Bridge {
            namespace = namespace.path(crate::network::netns_path(&config.id));
        }
        namespaces.push(namespace.build().map_err(&err)?);
    }

    let mut resources = LinuxResourcesBuilder::default().devices(vec![
        // Deny every device; the runtime adds its standard ones (null,
        // zero, full, random, urandom, tty, ptmx) after this rule.
        LinuxDeviceCgroupBuilder::default()
            .allow(false)
            .access("rwm")
            .build()
            .map_err(&err)?,
    ]);
    if let Some(bytes) = config.limits.memory_bytes {
        let bytes = i64::try_from(bytes)
            .map_err(|_| Error::Invalid(format!("memory limit {bytes} bytes is too large")))?;
        let mut memory = LinuxMemoryBuilder::default().limit(bytes);
        if host.swap_accounting {
            memory = memory.swap(bytes);
        }
        resources = resources.memory(memory.build().map_err(&err)?);
    }
    if let Some(quota) = config.limits.cpu_quota_us() {
        resources = resources.cpu(
            LinuxCpuBuilder::default()
                .quota(quota)
                .period(CPU_PERIOD_US)
                .build()
                .map_err(&err)?,
        );
    }
    if let Some(pids) = config.limits.pids {
        let pids = i64::try_from(pids)
            .map_err(|_| Error::Invalid(format!("pids limit {pids} is too large")))?;
        resources = resources.pids(
            LinuxPidsBuilder::default()
                .limit(pids)
                .build()
                .map_err(&err)?,
        );
    }

    let mut masked: Vec<String> = MASKED_PATHS.iter().map(|p| (*p).to_owned()).collect();
    masked.extend(host.secret_paths.iter().cloned());
    masked.extend(config.masked_paths.iter().cloned());

    let linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .resources(resources.build().map_err(&err)?)
        .cgroups_path(PathBuf::from(cgroups_path))
        .seccomp(seccomp().map_err(&err)?)
        .masked_paths(masked)
        .readonly_paths(
            READONLY_PATHS
                .iter()
                .map(|p| (*p).to_owned())
                .collect::<Vec<_>>(),
        )
        .build()
        .map_err(&err)?;

    let hostname: String = config.id.as_str().chars().take(63).collect();
    SpecBuilder::default()
        .version("1.0.2")
        .root(
            RootBuilder::default()
                .path(config.paths.rootfs())
                .readonly(false)
                .build()
                .map_err(&err)?,
        )
        .hostname(hostname)
        .process(process)
        .mounts(mounts(config, host, linkage.as_ref()).map_err(&err)?)
        .linux(linux)
        .build()
        .map_err(&err)
}

/// The process every sandbox process shares: root without extra
/// capabilities, no new privileges, the file limits, `/workspace`.
fn base_process(
    args: Vec<String>,
    env: Vec<String>,
    (nofile_soft, nofile_hard): (u64, u64),
) -> Result<Process, oci_spec::OciSpecError> {
    let caps: oci_spec::runtime::Capabilities = CAPABILITIES.iter().copied().collect();
    ProcessBuilder::default()
        .terminal(false)
        .user(
            UserBuilder::default()
                .uid(0u32)
                .gid(0u32)
                .umask(0o022u32)
                .build()?,
        )
        .args(args)
        .env(env)
        .cwd(WORKSPACE_PATH)
        .capabilities(
            LinuxCapabilitiesBuilder::default()
                .bounding(caps.clone())
                .effective(caps.clone())
                .permitted(caps)
                .inheritable(oci_spec::runtime::Capabilities::new())
                .ambient(oci_spec::runtime::Capabilities::new())
                .build()?,
        )
        .rlimits(vec![
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitNofile)
                .soft(nofile_soft)
                .hard(nofile_hard)
                .build()?,
        ])
        .no_new_privileges(true)
        .build()
}

/// `KEY=VALUE` lines: the defaults (`PATH`, `HOME`), then the sandbox's
/// env, then the command's, later ones winning.
fn environment(
    sandbox: &BTreeMap<String, String>,
    command: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut env: BTreeMap<&str, &str> = BTreeMap::new();
    env.insert("PATH", DEFAULT_PATH);
    env.insert("HOME", WORKSPACE_PATH);
    for (name, value) in sandbox.iter().chain(command.iter()) {
        env.insert(name, value);
    }
    env.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// The `process.json` of a command: the sandbox's own process (read back
/// from its `config.json`, so a runner that restarted needs nothing else)
/// with the command's argv, env and cwd. Capabilities, no-new-privileges
/// and limits stay the sandbox's; the runtime applies the sandbox's
/// seccomp filter and cgroups to it as well.
pub fn exec_process(
    sandbox_process: &Process,
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: Option<&str>,
) -> Result<Process> {
    crate::config::validate_env(env)?;
    if argv.first().is_none_or(|program| program.is_empty()) {
        return Err(Error::Invalid("command argv is empty".to_owned()));
    }
    let cwd = cwd.unwrap_or(WORKSPACE_PATH);
    if !cwd.starts_with('/') {
        return Err(Error::Invalid(format!(
            "command cwd {cwd:?} must be absolute"
        )));
    }
    // The sandbox's env as it was configured, minus the defaults (which
    // `environment` adds back), then the command's on top.
    let mut sandbox_env = BTreeMap::new();
    for line in sandbox_process.env().iter().flatten() {
        if let Some((name, value)) = line.split_once('=') {
            sandbox_env.insert(name.to_owned(), value.to_owned());
        }
    }
    let mut process = sandbox_process.clone();
    process.set_args(Some(argv.to_vec()));
    process.set_env(Some(environment(&sandbox_env, env)));
    process.set_cwd(PathBuf::from(cwd));
    Ok(process)
}

fn mount(
    destination: &str,
    typ: &str,
    source: impl Into<PathBuf>,
    options: &[&str],
) -> Result<Mount, oci_spec::OciSpecError> {
    MountBuilder::default()
        .destination(destination)
        .typ(typ)
        .source(source.into())
        .options(options.iter().map(|o| (*o).to_owned()).collect::<Vec<_>>())
        .build()
}

fn mounts(
    config: &SandboxConfig,
    host: &HostSystem,
    linkage: Option<&InitLinkage>,
) -> Result<Vec<Mount>, oci_spec::OciSpecError> {
    let mut mounts = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?,
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        )?,
        mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        )?,
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        )?,
        mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        )?,
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        )?,
        mount("/tmp", "tmpfs", "tmpfs", &["nosuid", "nodev", "mode=1777"])?,
        mount("/run", "tmpfs", "tmpfs", &["nosuid", "nodev", "mode=755"])?,
    ];
    for entry in host_entries(config, host) {
        if let SystemEntry::Directory(path) = entry {
            // Not `rbind`: a recursive bind would be read-only only at its
            // top, leaving any submount writable.
            mounts.push(mount(
                path,
                "bind",
                path.as_str(),
                &["bind", "ro", "nosuid", "nodev"],
            )?);
        }
    }
    mounts.push(mount(
        WORKSPACE_PATH,
        "bind",
        config.workspace.clone(),
        &["rbind", "rw", "nosuid", "nodev"],
    )?);
    mounts.push(mount(
        INIT_PATH,
        "bind",
        config.init.host_path.clone(),
        &["bind", "ro", "nosuid", "nodev"],
    )?);
    if let Some(linkage) = linkage {
        mounts.push(mount(
            INIT_LOADER_PATH,
            "bind",
            linkage.loader.clone(),
            &["bind", "ro", "nosuid", "nodev"],
        )?);
        for lib in &linkage.libs {
            let name = lib.file_name().map(|n| n.to_string_lossy().into_owned());
            mounts.push(mount(
                &format!("{INIT_LIBS_PATH}/{}", name.unwrap_or_default()),
                "bind",
                lib.clone(),
                &["bind", "ro", "nosuid", "nodev"],
            )?);
        }
    }
    // Over the host's (read-only) /etc/resolv.conf, which may name a stub
    // resolver on the host's loopback. Only where the host has one: the
    // read-only /etc offers no place to create a mount point. (runc
    // resolves a symlinked destination inside the rootfs, so
    // systemd-resolved's link into /run should land in the sandbox's own
    // /run tmpfs; only a plain file is exercised by the tests.)
    // An imported image's root is a writable overlay: the runtime makes
    // the mount point there if the image has none.
    let etc_from_host = host_entries(config, host)
        .iter()
        .any(|e| matches!(e, SystemEntry::Directory(p) if p == "/etc"));
    let resolv_conf_target = match config.image {
        RootImage::Host => etc_from_host && std::fs::symlink_metadata(RESOLV_CONF_PATH).is_ok(),
        RootImage::Tree(_) => true,
    };
    if config.network == Network::Bridge && resolv_conf_target {
        mounts.push(mount(
            RESOLV_CONF_PATH,
            "bind",
            config.paths.resolv_conf(),
            &["bind", "ro", "nosuid", "nodev", "noexec"],
        )?);
    }
    Ok(mounts)
}

/// The seccomp filter: allow by default, refuse [`DENIED_SYSCALLS`] with
/// `EPERM`, `clone` with namespace flags with `EPERM` and `clone3` with
/// `ENOSYS`, for every ABI of the host's architecture (a filter that named
/// only x86-64 would let the same calls through the 32-bit entry points).
pub fn seccomp() -> Result<LinuxSeccomp, oci_spec::OciSpecError> {
    let mut syscalls: Vec<LinuxSyscall> = Vec::new();
    let names: Vec<String> = DENIED_SYSCALLS
        .iter()
        .flat_map(|(_, names)| names.iter().map(|n| (*n).to_owned()))
        .collect();
    syscalls.push(
        LinuxSyscallBuilder::default()
            .names(names)
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(EPERM)
            .build()?,
    );
    for (_, flag) in CLONE_NAMESPACE_FLAGS {
        syscalls.push(
            LinuxSyscallBuilder::default()
                .names(vec!["clone".to_owned()])
                .action(LinuxSeccompAction::ScmpActErrno)
                .errno_ret(EPERM)
                .args(vec![
                    LinuxSeccompArgBuilder::default()
                        .index(0usize)
                        .value(*flag)
                        .value_two(*flag)
                        .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
                        .build()?,
                ])
                .build()?,
        );
    }
    syscalls.push(
        LinuxSyscallBuilder::default()
            .names(vec!["clone3".to_owned()])
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(ENOSYS)
            .build()?,
    );
    let mut builder = LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActAllow)
        .syscalls(syscalls);
    let architectures = match std::env::consts::ARCH {
        "x86_64" => vec![Arch::ScmpArchX86_64, Arch::ScmpArchX86, Arch::ScmpArchX32],
        "x86" => vec![Arch::ScmpArchX86],
        "aarch64" => vec![Arch::ScmpArchAarch64, Arch::ScmpArchArm],
        _ => Vec::new(),
    };
    if !architectures.is_empty() {
        builder = builder.architectures(architectures);
    }
    builder.build()
}

/// What a dynamically linked init needs from the host to run in a root
/// that is not the host's: its ELF interpreter and the libraries it loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitLinkage {
    pub loader: PathBuf,
    pub libs: Vec<PathBuf>,
}

/// The init binary's linkage (`None` for a static binary), found once per
/// binary: its `PT_INTERP`, then the libraries that loader resolves
/// (`ld.so --list`, which is what `ldd` runs).
pub fn init_linkage(init: &Path) -> Result<Option<InitLinkage>> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static FOUND: OnceLock<Mutex<HashMap<PathBuf, Option<InitLinkage>>>> = OnceLock::new();
    let found = FOUND.get_or_init(Default::default);
    if let Some(known) = found.lock().ok().and_then(|map| map.get(init).cloned()) {
        return Ok(known);
    }
    let linkage = match elf_interpreter(init)? {
        None => None,
        Some(loader) => {
            let output = std::process::Command::new(&loader)
                .arg("--list")
                .arg(init)
                .output()
                .map_err(|e| Error::io("run", &loader, e))?;
            if !output.status.success() {
                return Err(Error::Unsupported(format!(
                    "{} --list {} failed: {}",
                    loader.display(),
                    init.display(),
                    String::from_utf8_lossy(&output.stderr).trim()
                )));
            }
            let libs = String::from_utf8_lossy(&output.stdout)
                .lines()
                .filter_map(|line| line.split_once(" => ").map(|(_, rest)| rest))
                .filter_map(|rest| rest.split(" (").next())
                .map(PathBuf::from)
                .filter(|path| path.is_absolute())
                .collect();
            Some(InitLinkage { loader, libs })
        }
    };
    if let Ok(mut map) = found.lock() {
        map.insert(init.to_path_buf(), linkage.clone());
    }
    Ok(linkage)
}

/// The `PT_INTERP` of a 64-bit little-endian ELF file, `None` if it has
/// none (a static binary). Reads the headers only, not the whole binary.
fn elf_interpreter(path: &Path) -> Result<Option<PathBuf>> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::FileExt;
    const PT_INTERP: u32 = 3;
    const PHDR_BYTES: usize = 56;
    let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let unsupported = || {
        Error::Unsupported(format!(
            "{} is not a 64-bit little-endian ELF binary",
            path.display()
        ))
    };
    let read = |offset: u64, len: usize| -> Result<Vec<u8>> {
        let mut buffer = vec![0u8; len];
        file.read_exact_at(&mut buffer, offset)
            .map_err(|_| unsupported())?;
        Ok(buffer)
    };
    let le = |bytes: &[u8]| {
        bytes
            .iter()
            .rev()
            .fold(0u64, |n, b| (n << 8) | u64::from(*b))
    };
    let header = read(0, 64)?;
    if header[..6] != [0x7f, b'E', b'L', b'F', 2, 1] {
        return Err(unsupported());
    }
    let phoff = le(&header[0x20..0x28]);
    let phentsize = le(&header[0x36..0x38]);
    let phnum = le(&header[0x38..0x3a]);
    if phentsize < PHDR_BYTES as u64 || phnum > 4096 {
        return Err(unsupported());
    }
    for i in 0..phnum {
        let phdr = read(phoff + i * phentsize, PHDR_BYTES)?;
        if le(&phdr[0..4]) != u64::from(PT_INTERP) {
            continue;
        }
        let (offset, size) = (le(&phdr[8..16]), le(&phdr[0x20..0x28]));
        if size == 0 || size > 4096 {
            return Err(unsupported());
        }
        let raw = read(offset, size as usize)?;
        let name = raw.split(|b| *b == 0).next().unwrap_or_default();
        return Ok(Some(PathBuf::from(std::ffi::OsStr::from_bytes(name))));
    }
    Ok(None)
}

/// What the sandbox takes from the host's system: everything for the
/// default image, nothing for an imported one.
fn host_entries<'h>(config: &SandboxConfig, host: &'h HostSystem) -> &'h [SystemEntry] {
    match config.image {
        RootImage::Host => &host.entries,
        RootImage::Tree(_) => &[],
    }
}

/// Makes the sandbox's root directory on the host: the writable layer, the
/// merged-/usr symlinks and the mount points with their usual modes. Files
/// the sandbox wrote earlier are left as they are; a mismatched symlink
/// (the host changed) is replaced. For an imported image the root is an
/// overlay of the image under the sandbox's upper layer, mounted here.
pub fn prepare_rootfs(config: &SandboxConfig, host: &HostSystem) -> Result<()> {
    let rootfs = config.paths.rootfs();
    create_dir(&rootfs, 0o755)?;
    if let RootImage::Tree(lower) = &config.image {
        mount_overlay(&config.paths, lower)?;
    }
    for entry in host_entries(config, host) {
        match entry {
            SystemEntry::Directory(path) => create_dir(&rootfs.join(&path[1..]), 0o755)?,
            SystemEntry::Symlink { path, target } => {
                let link = rootfs.join(&path[1..]);
                match std::fs::read_link(&link) {
                    Ok(existing) if existing == *target => {}
                    Ok(_) => {
                        std::fs::remove_file(&link).map_err(|e| Error::io("replace", &link, e))?;
                        symlink(target, &link)?;
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => symlink(target, &link)?,
                    // A directory the sandbox made where the host has a
                    // symlink: leave it, the runtime will mount over it.
                    Err(_) => {}
                }
            }
        }
    }
    for (dir, mode) in [
        ("proc", 0o555),
        ("sys", 0o555),
        ("dev", 0o755),
        ("tmp", 0o1777),
        ("run", 0o755),
        ("workspace", 0o755),
        (".roost", 0o755),
        ("var", 0o755),
        ("var/tmp", 0o1777),
        ("root", 0o700),
        ("home", 0o755),
    ] {
        create_dir(&rootfs.join(dir), mode)?;
    }
    Ok(())
}

/// Mounts `lower` (read-only) under the sandbox's upper layer at its
/// rootfs, replacing a mount left by an earlier life of the sandbox (a
/// runner that died leaves its mounts behind).
fn mount_overlay(paths: &SandboxPaths, lower: &Path) -> Result<()> {
    use rustix::mount::{MountFlags, mount};
    let rootfs = paths.rootfs();
    unmount_rootfs(paths)?;
    for dir in [paths.upper(), paths.overlay_work()] {
        create_dir(&dir, 0o755)?;
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        overlay_path(lower)?,
        overlay_path(&paths.upper())?,
        overlay_path(&paths.overlay_work())?,
    );
    mount(
        "overlay",
        &rootfs,
        "overlay",
        MountFlags::NOSUID | MountFlags::NODEV,
        Some(
            std::ffi::CString::new(options)
                .map_err(|e| Error::io("mount", &rootfs, e.into()))?
                .as_c_str(),
        ),
    )
    .map_err(|e| Error::io("mount the image overlay at", &rootfs, e.into()))
}

/// A path as overlayfs options take it: `,` `:` and `\` would split or
/// escape the option string, so such paths are refused.
fn overlay_path(path: &Path) -> Result<String> {
    let text = path.to_str().unwrap_or("");
    if text.is_empty() || text.contains([',', ':', '\\']) {
        return Err(Error::Invalid(format!(
            "{} cannot be an overlay layer (use a path without , : or \\)",
            path.display()
        )));
    }
    Ok(text.to_owned())
}

/// Unmounts an imported image's overlay from the sandbox's rootfs, if
/// mounted (a plain directory, or nothing, is fine). Idempotent.
pub fn unmount_rootfs(paths: &SandboxPaths) -> Result<()> {
    use rustix::mount::{UnmountFlags, unmount};
    let rootfs = paths.rootfs();
    loop {
        match unmount(&rootfs, UnmountFlags::DETACH) {
            // Several lives may have stacked mounts: peel them all.
            Ok(()) => continue,
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => return Ok(()),
            Err(e) => return Err(Error::io("unmount", &rootfs, e.into())),
        }
    }
}

fn symlink(target: &Path, link: &Path) -> Result<()> {
    std::os::unix::fs::symlink(target, link).map_err(|e| Error::io("create symlink", link, e))
}

fn create_dir(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    match std::fs::DirBuilder::new().mode(mode).create(path) {
        Ok(()) => {
            // The umask may have cleared bits (1777 for tmp).
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                .map_err(|e| Error::io("set the mode of", path, e))
        }
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            if path.is_dir() {
                Ok(())
            } else {
                Err(Error::io("create directory", path, e))
            }
        }
        Err(e) => Err(Error::io("create directory", path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{InitProgram, Limits, SandboxId, SandboxPaths};

    fn host() -> HostSystem {
        HostSystem {
            entries: vec![
                SystemEntry::Symlink {
                    path: "/bin".into(),
                    target: "usr/bin".into(),
                },
                SystemEntry::Directory("/etc".into()),
                SystemEntry::Directory("/usr".into()),
            ],
            secret_paths: vec!["/etc/ssh/ssh_host_ed25519_key".into()],
            swap_accounting: true,
            nofile_hard_max: 20_000,
        }
    }

    fn config() -> SandboxConfig {
        let mut config = SandboxConfig::new(
            SandboxId::new("sbx_test").expect("valid id"),
            SandboxPaths::new("/var/lib/roost/sandboxes/sbx_test").expect("absolute"),
            "/var/lib/roost/homes/sbx_test",
            InitProgram {
                host_path: "/usr/bin/roost".into(),
                args: vec!["init".into()],
            },
        );
        config.limits = Limits {
            memory_bytes: Some(256 << 20),
            cpus: Some(1.5),
            pids: Some(128),
        };
        config.env.insert("LANG".into(), "C.UTF-8".into());
        config
    }

    fn json(config: &SandboxConfig) -> serde_json::Value {
        let spec = spec(config, &host(), "/roost/sbx_test").expect("spec builds");
        serde_json::to_value(&spec).expect("serialises")
    }

    #[test]
    fn process_and_isolation() {
        let value = json(&config());
        let process = &value["process"];
        assert_eq!(process["args"], serde_json::json!(["/.roost/init", "init"]));
        assert_eq!(process["cwd"], "/workspace");
        assert_eq!(process["noNewPrivileges"], true);
        assert_eq!(process["user"]["uid"], 0);
        // Capped at the runner's own hard limit.
        assert_eq!(process["rlimits"][0]["hard"], 20_000);
        assert_eq!(process["rlimits"][0]["soft"], NOFILE_SOFT);
        let env: Vec<&str> = process["env"]
            .as_array()
            .expect("env list")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert!(env.contains(&"HOME=/workspace"), "{env:?}");
        assert!(env.contains(&"LANG=C.UTF-8"), "{env:?}");
        let effective = process["capabilities"]["effective"]
            .as_array()
            .expect("caps");
        assert_eq!(effective.len(), CAPABILITIES.len());
        assert!(
            !effective
                .iter()
                .any(|c| c == "CAP_SYS_ADMIN" || c == "CAP_NET_RAW")
        );
        assert_eq!(process["capabilities"]["ambient"], serde_json::json!([]));

        let namespaces: Vec<&str> = value["linux"]["namespaces"]
            .as_array()
            .expect("namespaces")
            .iter()
            .filter_map(|n| n["type"].as_str())
            .collect();
        for ns in ["pid", "mount", "ipc", "uts", "cgroup", "network"] {
            assert!(namespaces.contains(&ns), "{ns} missing from {namespaces:?}");
        }
        assert!(!namespaces.contains(&"user"));
        assert_eq!(value["linux"]["cgroupsPath"], "/roost/sbx_test");
        assert_eq!(
            value["root"]["path"],
            "/var/lib/roost/sandboxes/sbx_test/rootfs"
        );
        assert_eq!(value["root"]["readonly"], false);
    }

    #[test]
    fn limits() {
        let value = json(&config());
        let resources = &value["linux"]["resources"];
        assert_eq!(resources["memory"]["limit"], 256 << 20);
        assert_eq!(resources["memory"]["swap"], 256 << 20);
        assert_eq!(resources["cpu"]["quota"], 150_000);
        assert_eq!(resources["cpu"]["period"], 100_000);
        assert_eq!(resources["pids"]["limit"], 128);
        assert_eq!(resources["devices"][0]["allow"], false);

        let mut no_swap_host = host();
        no_swap_host.swap_accounting = false;
        let spec = spec(&config(), &no_swap_host, "/roost/x").expect("spec");
        let value = serde_json::to_value(&spec).expect("json");
        assert!(value["linux"]["resources"]["memory"].get("swap").is_none());
    }

    #[test]
    fn mounts_and_masks() {
        let value = json(&config());
        let mounts = value["mounts"].as_array().expect("mounts");
        let find = |dest: &str| {
            mounts
                .iter()
                .find(|m| m["destination"] == dest)
                .unwrap_or_else(|| panic!("no mount at {dest}"))
        };
        let options = |dest: &str| -> Vec<String> {
            find(dest)["options"]
                .as_array()
                .expect("options")
                .iter()
                .filter_map(|o| o.as_str().map(str::to_owned))
                .collect()
        };
        for dest in ["/usr", "/etc", "/.roost/init"] {
            assert!(
                options(dest).contains(&"ro".to_owned()),
                "{dest} not read-only"
            );
        }
        assert_eq!(find("/.roost/init")["source"], "/usr/bin/roost");
        assert_eq!(
            find("/workspace")["source"],
            "/var/lib/roost/homes/sbx_test"
        );
        assert!(options("/workspace").contains(&"rw".to_owned()));
        assert!(options("/sys").contains(&"ro".to_owned()));
        for dest in ["/tmp", "/run", "/proc", "/dev", "/dev/pts", "/dev/shm"] {
            find(dest);
        }
        // A symlinked /bin is not mounted: the rootfs gets the symlink.
        assert!(mounts.iter().all(|m| m["destination"] != "/bin"));
        let masked = value["linux"]["maskedPaths"].as_array().expect("masked");
        for path in [
            "/proc/kcore",
            "/etc/shadow",
            "/etc/ssh/ssh_host_ed25519_key",
        ] {
            assert!(masked.iter().any(|m| m == path), "{path} not masked");
        }
        let readonly = value["linux"]["readonlyPaths"]
            .as_array()
            .expect("readonly");
        assert!(readonly.iter().any(|p| p == "/proc/sys"));
    }

    #[test]
    fn seccomp_profile() {
        let value = json(&config());
        let seccomp = &value["linux"]["seccomp"];
        assert_eq!(seccomp["defaultAction"], "SCMP_ACT_ALLOW");
        let rules = seccomp["syscalls"].as_array().expect("rules");
        let denied: Vec<&str> = rules[0]["names"]
            .as_array()
            .expect("names")
            .iter()
            .filter_map(|n| n.as_str())
            .collect();
        for name in [
            "kexec_load",
            "init_module",
            "finit_module",
            "delete_module",
            "bpf",
            "perf_event_open",
            "mount",
            "umount2",
            "swapon",
            "swapoff",
            "reboot",
            "settimeofday",
            "clock_settime",
            "open_by_handle_at",
            "keyctl",
            "add_key",
            "request_key",
            "userfaultfd",
            "ptrace",
            "unshare",
        ] {
            assert!(denied.contains(&name), "{name} not denied");
        }
        assert_eq!(rules[0]["action"], "SCMP_ACT_ERRNO");
        assert_eq!(rules[0]["errnoRet"], 1);
        let clone_rules = rules.iter().filter(|r| r["names"][0] == "clone").count();
        assert_eq!(clone_rules, CLONE_NAMESPACE_FLAGS.len());
        let clone3 = rules
            .iter()
            .find(|r| r["names"][0] == "clone3")
            .expect("clone3");
        assert_eq!(clone3["errnoRet"], 38);
    }

    #[test]
    fn workload_follows_the_separator() {
        let mut config = config();
        config.workload = vec!["sleep".into(), "5".into()];
        let value = json(&config);
        assert_eq!(
            value["process"]["args"],
            serde_json::json!(["/.roost/init", "init", "--", "sleep", "5"])
        );
    }

    fn network_namespace(value: &serde_json::Value) -> serde_json::Value {
        value["linux"]["namespaces"]
            .as_array()
            .expect("namespaces")
            .iter()
            .find(|n| n["type"] == "network")
            .expect("a network namespace")
            .clone()
    }

    #[test]
    fn none_gets_a_fresh_namespace_and_the_hosts_resolv_conf() {
        let value = json(&config());
        assert!(network_namespace(&value).get("path").is_none());
        let mounts = value["mounts"].as_array().expect("mounts");
        assert!(mounts.iter().all(|m| m["destination"] != RESOLV_CONF_PATH));
    }

    #[test]
    fn bridge_joins_the_prepared_namespace_with_its_own_resolv_conf() {
        let mut config = config();
        config.network = Network::Bridge;
        let value = json(&config);
        assert_eq!(
            network_namespace(&value)["path"],
            "/run/netns/roost-sbx_test"
        );
        // Mounted only over a host file that exists (see `mounts`).
        if Path::new(RESOLV_CONF_PATH).exists() {
            let mounts = value["mounts"].as_array().expect("mounts");
            let resolv = mounts
                .iter()
                .find(|m| m["destination"] == RESOLV_CONF_PATH)
                .expect("resolv.conf mounted");
            assert_eq!(
                resolv["source"],
                "/var/lib/roost/sandboxes/sbx_test/bundle/resolv.conf"
            );
            let options = resolv["options"].as_array().expect("options");
            assert!(options.iter().any(|o| o == "ro"), "{options:?}");
        }
    }

    #[test]
    fn exec_process_keeps_the_sandbox_posture() {
        let spec = spec(&config(), &host(), "/roost/x").expect("spec");
        let base = spec.process().as_ref().expect("process");
        let env = BTreeMap::from([
            ("LANG".to_owned(), "C".to_owned()),
            ("X".to_owned(), "1".to_owned()),
        ]);
        let process =
            exec_process(base, &["ls".into(), "-l".into()], &env, Some("/tmp")).expect("process");
        let value = serde_json::to_value(&process).expect("json");
        assert_eq!(value["args"], serde_json::json!(["ls", "-l"]));
        assert_eq!(value["cwd"], "/tmp");
        assert_eq!(value["noNewPrivileges"], true);
        assert_eq!(
            value["capabilities"],
            serde_json::to_value(base.capabilities()).expect("caps")
        );
        let env: Vec<&str> = value["env"]
            .as_array()
            .expect("env")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert!(env.contains(&"LANG=C"), "{env:?}");
        assert!(env.contains(&"X=1"), "{env:?}");
        assert!(env.contains(&"HOME=/workspace"), "{env:?}");
        assert!(exec_process(base, &[], &env_empty(), None).is_err());
        assert!(exec_process(base, &["ls".into()], &env_empty(), Some("tmp")).is_err());
    }

    fn env_empty() -> BTreeMap<String, String> {
        BTreeMap::new()
    }
}
