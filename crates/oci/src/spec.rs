//! The OCI runtime configuration (`config.json`) of a sandbox, generated in
//! code with `oci-spec`: the process, the mounts, the namespaces and the
//! cgroup limits, with the policy of [`crate::security`] and what
//! [`crate::probe`] found on the host. The root directory it points at is
//! made by [`crate::rootfs`].
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
//!                     default cwd; or a shared filesystem's directory, and
//!                     then the caller's directory is at /private
//! /mnt/…              shared filesystems' directories (crate::shared),
//!                     nosuid, nodev, read-only where asked
//! /tmp /run           fresh tmpfs (charged to the memory cgroup)
//! /proc /sys /dev     proc; sysfs read-only; tmpfs /dev with the standard
//!                     devices the runtime creates, devpts, a 64 MiB /dev/shm,
//!                     mqueue; /sys/fs/cgroup read-only in its own cgroup ns
//! /.roost/init        the init binary, bind-mounted read-only
//! /.roost/lease       the runner's lease deadline the init watches
//!                     (crate::lease), bind-mounted read-only
//! /run/secrets        delivered secret files (only when the sandbox has
//!                     some): a host directory on a tmpfs, bind-mounted
//!                     read-only over the sandbox's own /run tmpfs
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
//! Capabilities, `noNewPrivileges`, masked paths and the seccomp filter:
//! [`crate::security`]. Cgroup limits for memory (swap disabled where the
//! host accounts swap), CPU quota and pids; device access denied except the
//! runtime's standard devices.

use std::collections::BTreeMap;
use std::path::PathBuf;

use oci_spec::runtime::{
    LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxDeviceCgroupBuilder,
    LinuxMemoryBuilder, LinuxNamespaceBuilder, LinuxNamespaceType, LinuxPidsBuilder,
    LinuxResourcesBuilder, Mount, MountBuilder, PosixRlimitBuilder, PosixRlimitType, Process,
    ProcessBuilder, RootBuilder, Spec, SpecBuilder, UserBuilder,
};

use crate::config::{CPU_PERIOD_US, Network, RootImage, SandboxConfig};
use crate::error::{Error, Result};
use crate::probe::{HostSystem, InitLinkage, SystemEntry, init_linkage};
use crate::security::{
    CAPABILITIES, MASKED_PATHS, NOFILE_HARD, NOFILE_SOFT, READONLY_PATHS, seccomp,
};

/// Where the init binary appears inside every sandbox.
pub const INIT_PATH: &str = "/.roost/init";
/// The host's dynamic loader, for the init inside an imported image.
pub const INIT_LOADER_PATH: &str = "/.roost/ld.so";
/// The host libraries the init links against, one bind mount each.
pub const INIT_LIBS_PATH: &str = "/.roost/lib";
/// The sandbox's home: `$HOME`, the default cwd, the caller's host directory.
pub const WORKSPACE_PATH: &str = "/workspace";
/// The sandbox's own home when a shared filesystem owns `/workspace`.
pub const PRIVATE_PATH: &str = "/private";
/// Where a sandbox's delivered secret files appear.
pub const SECRETS_PATH: &str = "/run/secrets";
/// A `bridge` sandbox's DNS configuration (see [`SandboxPaths::resolv_conf`]).
///
/// [`SandboxPaths::resolv_conf`]: crate::SandboxPaths::resolv_conf
pub const RESOLV_CONF_PATH: &str = "/etc/resolv.conf";
/// `PATH` of the init, the workload and commands unless overridden.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

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
    if config.lease_dir.is_some() {
        args.push(crate::lease::LEASE_FLAG.to_owned());
        args.push(crate::lease::LEASE_PATH.to_owned());
    }
    // The agent's listening socket, passed by the runtime (`--preserve-fds`).
    args.push(crate::agent::AGENT_FD_FLAG.to_owned());
    args.push(crate::agent::AGENT_FD.to_string());
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
    if matches!(config.image, RootImage::Host) {
        masked.extend(host.secret_paths.iter().cloned());
    }
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
    for entry in host.entries_for(&config.image) {
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
    // The sandbox's own home, at /workspace unless a shared filesystem
    // owns it. `$HOME` and the cwd stay /workspace either way.
    let shared_workspace = config
        .shared
        .iter()
        .any(|m| m.destination == WORKSPACE_PATH);
    mounts.push(mount(
        if shared_workspace {
            PRIVATE_PATH
        } else {
            WORKSPACE_PATH
        },
        "bind",
        config.workspace.clone(),
        &["rbind", "rw", "nosuid", "nodev"],
    )?);
    // Staged by `crate::shared` from descriptors opened beneath each
    // filesystem's root; not `rbind`: nothing mounted below comes along.
    for (i, shared) in config.shared.iter().enumerate() {
        mounts.push(mount(
            &shared.destination,
            "bind",
            crate::shared::staged(&config.paths, i),
            &[
                "bind",
                if shared.read_only { "ro" } else { "rw" },
                "nosuid",
                "nodev",
            ],
        )?);
    }
    mounts.push(mount(
        INIT_PATH,
        "bind",
        config.init.host_path.clone(),
        &["bind", "ro", "nosuid", "nodev"],
    )?);
    if let Some(lease_dir) = &config.lease_dir {
        // Read-only: nothing in the sandbox may renew its own lease.
        mounts.push(mount(
            crate::lease::LEASE_PATH,
            "bind",
            lease_dir.clone(),
            &["bind", "ro", "nosuid", "nodev", "noexec"],
        )?);
    }
    if let Some(secrets_dir) = &config.secrets_dir {
        // After /run (a tmpfs of the sandbox's own, where the runtime makes
        // the mount point); read-only: a sandbox cannot change what it was
        // given, nor add files the runner would then hold.
        mounts.push(mount(
            SECRETS_PATH,
            "bind",
            secrets_dir.clone(),
            &["bind", "ro", "nosuid", "nodev", "noexec"],
        )?);
    }
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
    let etc_from_host = host
        .entries_for(&config.image)
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
        assert_eq!(
            process["args"],
            serde_json::json!(["/.roost/init", "init", "--agent-fd", "3"])
        );
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
    fn workload_follows_the_separator() {
        let mut config = config();
        config.workload = vec!["sleep".into(), "5".into()];
        let value = json(&config);
        assert_eq!(
            value["process"]["args"],
            serde_json::json!([
                "/.roost/init",
                "init",
                "--agent-fd",
                "3",
                "--",
                "sleep",
                "5"
            ])
        );
    }

    /// With a lease directory, the init is told to watch it, and sees it
    /// read-only: nothing in the sandbox can renew its own lease.
    #[test]
    fn a_lease_directory_is_watched_by_the_init_and_read_only_inside() {
        assert!(
            json(&config())["mounts"]
                .as_array()
                .expect("mounts")
                .iter()
                .all(|m| m["destination"] != crate::lease::LEASE_PATH)
        );
        let mut config = config();
        config.lease_dir = Some("/var/lib/roost/sandboxes/sbx_test/lease".into());
        config.workload = vec!["sleep".into(), "5".into()];
        let value = json(&config);
        assert_eq!(
            value["process"]["args"],
            serde_json::json!([
                "/.roost/init",
                "init",
                "--lease-dir",
                "/.roost/lease",
                "--agent-fd",
                "3",
                "--",
                "sleep",
                "5"
            ])
        );
        let lease = value["mounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .find(|m| m["destination"] == crate::lease::LEASE_PATH)
            .expect("the lease directory is mounted");
        assert_eq!(lease["source"], "/var/lib/roost/sandboxes/sbx_test/lease");
        let options = lease["options"].as_array().expect("options");
        assert!(options.iter().any(|o| o == "ro"), "{options:?}");
        config.lease_dir = Some("relative/lease".into());
        assert!(spec(&config, &host(), "/roost/x").is_err());
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
        if std::path::Path::new(RESOLV_CONF_PATH).exists() {
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

    #[test]
    fn a_shared_workspace_moves_the_home_to_private() {
        let mut config = config();
        for (destination, read_only) in [("/workspace", false), ("/mnt/data", true)] {
            config.shared.push(crate::config::SharedMount {
                name: "team".to_owned(),
                root: "/srv/team".into(),
                subpath: "proj".to_owned(),
                destination: destination.to_owned(),
                read_only,
            });
        }
        let value = json(&config);
        let mounts = value["mounts"].as_array().expect("mounts");
        let find = |dest: &str| {
            mounts
                .iter()
                .find(|m| m["destination"] == dest)
                .unwrap_or_else(|| panic!("no mount at {dest}"))
        };
        assert_eq!(
            find(PRIVATE_PATH)["source"],
            "/var/lib/roost/homes/sbx_test"
        );
        let shared = find(WORKSPACE_PATH);
        assert_eq!(
            shared["source"], "/var/lib/roost/sandboxes/sbx_test/shared/0",
            "bound from its staging, never from the filesystem's path"
        );
        let options = |m: &serde_json::Value| m["options"].to_string();
        assert!(options(shared).contains("\"rw\"") && options(shared).contains("nosuid"));
        let data = find("/mnt/data");
        assert!(options(data).contains("\"ro\"") && options(data).contains("nodev"));
        assert!(!options(data).contains("rbind"));
        // HOME and the cwd stay /workspace.
        assert_eq!(value["process"]["cwd"], "/workspace");

        let mut bad = config.clone();
        bad.shared[1].destination = "/etc".to_owned();
        assert!(spec(&bad, &host(), "/roost/x").is_err());
        let mut bad = config;
        bad.shared[1].subpath = "../x".to_owned();
        assert!(spec(&bad, &host(), "/roost/x").is_err());
    }

    #[test]
    fn delivered_secrets_are_a_read_only_mount_over_the_sandboxes_own_run() {
        let plain = json(&config());
        let mounts = plain["mounts"].as_array().expect("mounts");
        assert!(!mounts.iter().any(|m| m["destination"] == SECRETS_PATH));
        let mut with_secrets = config();
        with_secrets.secrets_dir = Some("/run/roost/secrets/x/sbx_test/files".into());
        let value = json(&with_secrets);
        let mounts = value["mounts"].as_array().expect("mounts");
        let run = mounts
            .iter()
            .position(|m| m["destination"] == "/run")
            .expect("/run");
        let secrets = mounts
            .iter()
            .position(|m| m["destination"] == SECRETS_PATH)
            .expect("/run/secrets");
        assert!(run < secrets, "/run/secrets must come after /run");
        assert_eq!(mounts[run]["type"], "tmpfs");
        let options = mounts[secrets]["options"].as_array().expect("options");
        for wanted in ["ro", "nosuid", "nodev", "noexec"] {
            assert!(options.iter().any(|o| o == wanted), "{options:?}");
        }
        // /tmp is a tmpfs too: neither is part of a home, so neither is saved.
        assert!(
            mounts
                .iter()
                .any(|m| m["destination"] == "/tmp" && m["type"] == "tmpfs")
        );
    }
}
