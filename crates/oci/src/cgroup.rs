//! The host's cgroup layout (v1, hybrid or pure v2), found from
//! `/proc/self/mountinfo`, and the counters this layer reads from a
//! sandbox's cgroup: OOM kills (the only trustworthy witness of a memory
//! kill: the victim just sees SIGKILL) and the current number of pids.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::host::unescape_mountinfo;

/// How cgroups are mounted on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupHost {
    /// Mount points of v1 controllers by controller name (`memory`,
    /// `pids`…); empty on a pure v2 host.
    pub v1: Vec<(String, PathBuf)>,
    /// The cgroup2 mount, if any (on a hybrid host it carries no
    /// controllers the runtime uses, at `/sys/fs/cgroup/unified`).
    pub v2: Option<PathBuf>,
}

impl CgroupHost {
    pub fn probe() -> Result<Self> {
        let path = Path::new("/proc/self/mountinfo");
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
        Ok(Self::parse_mountinfo(&text))
    }

    /// Reads mountinfo lines: `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS
    /// [OPTIONAL…] - FSTYPE SOURCE SUPEROPTS`.
    pub fn parse_mountinfo(text: &str) -> Self {
        let mut v1 = Vec::new();
        let mut v2 = None;
        for line in text.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let Some(mount_point) = left.split(' ').nth(4) else {
                continue;
            };
            let mount_point = PathBuf::from(unescape_mountinfo(mount_point));
            let mut right = right.split(' ');
            let fstype = right.next().unwrap_or_default();
            let super_options = right.nth(1).unwrap_or_default();
            match fstype {
                "cgroup2" if v2.is_none() => v2 = Some(mount_point),
                "cgroup" => {
                    for option in super_options.split(',') {
                        if matches!(
                            option,
                            "memory"
                                | "pids"
                                | "cpu"
                                | "cpuacct"
                                | "cpuset"
                                | "devices"
                                | "freezer"
                                | "blkio"
                                | "hugetlb"
                                | "net_cls"
                                | "net_prio"
                                | "perf_event"
                                | "rdma"
                                | "misc"
                        ) && !v1.iter().any(|(name, _)| name == option)
                        {
                            v1.push((option.to_owned(), mount_point.clone()));
                        }
                    }
                }
                _ => {}
            }
        }
        CgroupHost { v1, v2 }
    }

    /// A pure cgroup v2 host: the unified hierarchy at `/sys/fs/cgroup` and
    /// no v1 controller mounted anywhere. The only kind of host crun runs
    /// on reliably (it refuses hybrid hosts whose v2 side has controllers).
    pub fn is_pure_v2(&self) -> bool {
        self.v1.is_empty() && self.v2.as_deref() == Some(Path::new("/sys/fs/cgroup"))
    }

    fn v1_mount(&self, controller: &str) -> Option<&Path> {
        self.v1
            .iter()
            .find(|(name, _)| name == controller)
            .map(|(_, path)| path.as_path())
    }

    /// The directory of `cgroups_path` (`/parent/id`) for `controller`:
    /// under the v1 controller's mount if it has one, else under the v2
    /// mount.
    pub fn dir(&self, controller: &str, cgroups_path: &str) -> Option<PathBuf> {
        let relative = cgroups_path.trim_start_matches('/');
        if !self.v1.is_empty() {
            return self.v1_mount(controller).map(|m| m.join(relative));
        }
        self.v2.as_ref().map(|m| m.join(relative))
    }

    /// Whether the memory controller accounts swap, so a config may pin
    /// swap to zero.
    pub fn swap_accounting(&self) -> bool {
        if let Some(memory) = self.v1_mount("memory") {
            return memory.join("memory.memsw.limit_in_bytes").exists();
        }
        if let Some(v2) = &self.v2 {
            // The root has no memory.swap.max; look at the runner's own.
            return std::fs::read_to_string("/proc/self/cgroup")
                .ok()
                .and_then(|text| {
                    text.lines()
                        .find_map(|l| l.strip_prefix("0::"))
                        .map(|p| v2.join(p.trim_start_matches('/')))
                })
                .is_some_and(|own| own.join("memory.swap.max").exists());
        }
        false
    }

    /// Every directory the sandbox's cgroup has on this host, one per
    /// hierarchy (used to check that delete removed them all).
    pub fn all_dirs(&self, cgroups_path: &str) -> Vec<PathBuf> {
        let relative = cgroups_path.trim_start_matches('/');
        let mut dirs: Vec<PathBuf> = Vec::new();
        for (_, mount) in &self.v1 {
            let dir = mount.join(relative);
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        if let Some(v2) = &self.v2 {
            dirs.push(v2.join(relative));
        }
        dirs
    }

    /// OOM kills recorded in the sandbox's memory cgroup so far: `oom_kill`
    /// of v1 `memory.oom_control` or v2 `memory.events`. `None` when the
    /// cgroup is gone (deleted) or the kernel does not count kills.
    pub fn oom_kills(&self, cgroups_path: &str) -> Option<u64> {
        let dir = self.dir("memory", cgroups_path)?;
        let file = if self.v1_mount("memory").is_some() {
            "memory.oom_control"
        } else {
            "memory.events"
        };
        let text = std::fs::read_to_string(dir.join(file)).ok()?;
        parse_keyed(&text, "oom_kill")
    }

    /// Processes (and threads) in the sandbox's cgroup now.
    pub fn pids_current(&self, cgroups_path: &str) -> Option<u64> {
        let dir = self.dir("pids", cgroups_path)?;
        std::fs::read_to_string(dir.join("pids.current"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

/// The value of `key` in a flat-keyed cgroup file (`key value` lines).
fn parse_keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == key).then(|| value.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 25 0:24 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
27 26 0:25 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
28 26 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
29 26 0:27 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
30 26 0:28 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
31 26 0:29 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    const PURE_V2: &str = "\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 25 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

    #[test]
    fn hybrid_host() {
        let host = CgroupHost::parse_mountinfo(HYBRID);
        assert!(!host.is_pure_v2());
        assert_eq!(
            host.dir("memory", "/roost/sbx_1"),
            Some(PathBuf::from("/sys/fs/cgroup/memory/roost/sbx_1"))
        );
        assert_eq!(
            host.dir("pids", "/roost/sbx_1"),
            Some(PathBuf::from("/sys/fs/cgroup/pids/roost/sbx_1"))
        );
        assert_eq!(host.v2, Some(PathBuf::from("/sys/fs/cgroup/unified")));
        // name=systemd is not a controller; the unified dir is listed.
        let dirs = host.all_dirs("/roost/x");
        assert_eq!(dirs.len(), 4, "{dirs:?}");
    }

    #[test]
    fn pure_v2_host() {
        let host = CgroupHost::parse_mountinfo(PURE_V2);
        assert!(host.is_pure_v2());
        assert_eq!(
            host.dir("memory", "/roost/sbx_1"),
            Some(PathBuf::from("/sys/fs/cgroup/roost/sbx_1"))
        );
    }

    #[test]
    fn keyed_files() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_keyed(v1, "oom_kill"), Some(3));
        let v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_keyed(v2, "oom_kill"), Some(2));
        assert_eq!(parse_keyed("oom 1\n", "oom_kill"), None);
    }
}
