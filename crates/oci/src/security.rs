//! The security policy every sandbox runs under, as data: the capability
//! set, the masked and read-only paths, the open-file limits and the
//! seccomp filter. [`crate::spec`] puts it into each `config.json`.
//!
//! Capabilities: Docker's default set minus `CAP_NET_RAW` (see
//! [`CAPABILITIES`]); none inheritable or ambient. `noNewPrivileges`. A
//! seccomp filter (see [`seccomp`]). Host secrets that the read-only `/etc`
//! of the default image would otherwise show (shadow files, SSH host keys,
//! whatever the caller adds) are masked, like Docker's masked `/proc`
//! entries.
//!
//! There is no user namespace yet: root in the sandbox is root on the host
//! minus capabilities, seccomp and the mounts of [`crate::spec`]. That is
//! Docker's default posture; a user namespace is the next step up.

use oci_spec::runtime::{
    Arch, Capability, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder,
    LinuxSeccompBuilder, LinuxSeccompOperator, LinuxSyscall, LinuxSyscallBuilder,
};

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
/// host and added (see [`crate::probe::HostSystem::probe`]). Paths missing on a host are
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
/// ([`crate::probe::HostSystem::nofile_hard_max`]).
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
pub(crate) const CLONE_NAMESPACE_FLAGS: &[(&str, u64)] = &[
    ("CLONE_NEWNS", 0x0002_0000),
    ("CLONE_NEWCGROUP", 0x0200_0000),
    ("CLONE_NEWUTS", 0x0400_0000),
    ("CLONE_NEWIPC", 0x0800_0000),
    ("CLONE_NEWUSER", 0x1000_0000),
    ("CLONE_NEWPID", 0x2000_0000),
    ("CLONE_NEWNET", 0x4000_0000),
];

/// btrfs `ioctl`s that make a subvolume or a snapshot, refused with
/// `EPERM`: a subvolume made inside a home is counted apart from the home
/// (its own quota group), so a workload could write past its home's bound
/// (`volumes::HomeVolumes::bound`) through one, and fill the runner's homes
/// volume. `_IOW(0x94, nr, 4096)`: both argument structs are 4 KiB.
pub(crate) const BTRFS_SUBVOLUME_IOCTLS: &[(&str, u64)] = &[
    ("BTRFS_IOC_SNAP_CREATE", 0x5000_9401),
    ("BTRFS_IOC_SUBVOL_CREATE", 0x5000_940e),
    ("BTRFS_IOC_SNAP_CREATE_V2", 0x5000_9417),
    ("BTRFS_IOC_SUBVOL_CREATE_V2", 0x5000_9418),
];

/// The seccomp filter: allow by default, refuse [`DENIED_SYSCALLS`] with
/// `EPERM`, `clone` with namespace flags and the ioctls of
/// [`BTRFS_SUBVOLUME_IOCTLS`] with `EPERM` and `clone3` with
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
        let arg = LinuxSeccompArgBuilder::default()
            .index(0usize)
            .value(*flag)
            .value_two(*flag)
            .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
            .build()?;
        syscalls.push(refused_with_arg("clone", arg)?);
    }
    for (_, request) in BTRFS_SUBVOLUME_IOCTLS {
        let arg = LinuxSeccompArgBuilder::default()
            .index(1usize)
            .value(*request)
            .op(LinuxSeccompOperator::ScmpCmpEq)
            .build()?;
        syscalls.push(refused_with_arg("ioctl", arg)?);
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

/// A rule refusing `name` with `EPERM` when its argument matches `arg`.
fn refused_with_arg(
    name: &str,
    arg: oci_spec::runtime::LinuxSeccompArg,
) -> Result<LinuxSyscall, oci_spec::OciSpecError> {
    LinuxSyscallBuilder::default()
        .names(vec![name.to_owned()])
        .action(LinuxSeccompAction::ScmpActErrno)
        .errno_ret(EPERM)
        .args(vec![arg])
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seccomp_profile() {
        let seccomp = serde_json::to_value(seccomp().expect("filter builds")).expect("json");
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
}
