//! What the runner offers by default, read from the host: CPUs, memory,
//! the process limit and a name.

use api::runners::Capacity;

/// Sandboxes a runner takes by default, whatever the host's size: each
/// costs a few runtime processes at start and a cgroup while it lives.
pub const DEFAULT_SANDBOXES: u64 = 64;

/// The host's capacity: every CPU, all memory (`MemTotal`), and the
/// kernel's pid limit. The runner does not reserve a share for itself; an
/// operator who wants one passes `--capacity`.
pub fn capacity() -> Capacity {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get() as f64)
        .unwrap_or(1.0);
    let memory_mib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .as_deref()
        .and_then(mem_total_mib)
        .unwrap_or(1024);
    let pids = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok())
        .unwrap_or(32_768);
    Capacity {
        sandboxes: DEFAULT_SANDBOXES,
        memory_mib,
        cpus,
        pids,
    }
}

/// `MemTotal:  24683800 kB` → MiB.
fn mem_total_mib(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// The host's name (the runner's default name), or `runner`.
pub fn hostname() -> String {
    let name = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let name: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(64)
        .collect();
    if name.is_empty() {
        "runner".to_owned()
    } else {
        name
    }
}

/// Applies `sandboxes=N,memory_mib=M,cpus=C,pids=P` (any subset) to
/// `capacity`.
pub fn parse_capacity(text: &str, mut capacity: Capacity) -> Result<Capacity, String> {
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("capacity {part:?}: use KEY=VALUE"))?;
        let whole = || {
            value
                .parse::<u64>()
                .map_err(|_| format!("capacity {key}={value:?}: not a whole number"))
        };
        match key {
            "sandboxes" => capacity.sandboxes = whole()?,
            "memory_mib" => capacity.memory_mib = whole()?,
            "pids" => capacity.pids = whole()?,
            "cpus" => {
                capacity.cpus = value
                    .parse::<f64>()
                    .ok()
                    .filter(|c| c.is_finite() && *c >= 0.0)
                    .ok_or_else(|| format!("capacity cpus={value:?}: not a number of CPUs"))?;
            }
            other => {
                return Err(format!(
                    "capacity {other:?}: use sandboxes, memory_mib, cpus or pids"
                ));
            }
        }
    }
    Ok(capacity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo() {
        let text = "MemTotal:       24683800 kB\nMemFree:         1234 kB\n";
        assert_eq!(mem_total_mib(text), Some(24105));
        assert_eq!(mem_total_mib("nothing"), None);
    }

    #[test]
    fn capacity_overrides() {
        let base = Capacity {
            sandboxes: 1,
            memory_mib: 2,
            cpus: 3.0,
            pids: 4,
        };
        let parsed = parse_capacity("sandboxes=20, cpus=0.5", base.clone()).expect("parses");
        assert_eq!(parsed.sandboxes, 20);
        assert_eq!(parsed.cpus, 0.5);
        assert_eq!(parsed.memory_mib, 2);
        assert!(parse_capacity("disks=1", base.clone()).is_err());
        assert!(parse_capacity("cpus=-1", base.clone()).is_err());
        assert!(parse_capacity("pids", base).is_err());
    }

    #[test]
    fn the_host_has_something() {
        let capacity = capacity();
        assert!(capacity.cpus >= 1.0);
        assert!(capacity.memory_mib > 0);
        assert!(!hostname().is_empty());
    }
}
