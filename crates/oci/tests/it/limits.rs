//! Cgroup limits: where they land on this host, and what happens when a
//! command runs into them.

use std::time::Duration;

use oci::{CommandSpec, DeathCause, InitEnd, Limits, Observation, Outcome, Stream};

use crate::support::{TestSandbox, eventually, prepare};

const MIB: u64 = 1 << 20;

fn read_trimmed(path: std::path::PathBuf) -> String {
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .trim()
        .to_owned()
}

#[tokio::test]
async fn limits_land_in_the_sandboxs_cgroup() {
    let limits = Limits {
        memory_bytes: Some(96 * MIB),
        cpus: Some(0.5),
        pids: Some(64),
    };
    let t = TestSandbox::start("cgroup", limits).await;
    let cgroups = t.runtime.cgroups();
    let path = t.sandbox.cgroups_path();
    let file = |controller: &str, name: &str| {
        cgroups
            .dir(controller, path)
            .unwrap_or_else(|| panic!("no {controller} cgroup"))
            .join(name)
    };
    if cgroups.v1.is_empty() {
        assert_eq!(
            read_trimmed(file("memory", "memory.max")),
            (96 * MIB).to_string()
        );
        assert_eq!(read_trimmed(file("cpu", "cpu.max")), "50000 100000");
        assert_eq!(read_trimmed(file("pids", "pids.max")), "64");
    } else {
        assert_eq!(
            read_trimmed(file("memory", "memory.limit_in_bytes")),
            (96 * MIB).to_string()
        );
        if cgroups.swap_accounting() {
            assert_eq!(
                read_trimmed(file("memory", "memory.memsw.limit_in_bytes")),
                (96 * MIB).to_string(),
                "swap is not pinned to zero"
            );
        }
        assert_eq!(read_trimmed(file("cpu", "cpu.cfs_quota_us")), "50000");
        assert_eq!(read_trimmed(file("cpu", "cpu.cfs_period_us")), "100000");
        assert_eq!(read_trimmed(file("pids", "pids.max")), "64");
    }
    // The sandbox's processes are in it.
    let init_pid = t
        .sandbox
        .state()
        .await
        .expect("state")
        .and_then(|s| s.init_pid)
        .expect("init pid");
    let procs = read_trimmed(file("pids", "cgroup.procs"));
    assert!(
        procs.lines().any(|p| p == init_pid.to_string()),
        "init {init_pid} not in {procs:?}"
    );
    // Inside, the sandbox sees only its own cgroup (a cgroup namespace).
    let own = t.sh_ok("cat /proc/self/cgroup").await;
    assert!(!own.contains("roost-test"), "{own}");
}

#[tokio::test]
async fn a_fork_bomb_is_contained_by_the_pids_limit() {
    let limits = Limits {
        pids: Some(32),
        cpus: Some(0.5),
        ..Limits::default()
    };
    let t = TestSandbox::start("forkbomb", limits).await;
    // A subshell forks long-lived processes until forking fails (a shell
    // that cannot fork exits 2; that is ignored); the sleepers it made
    // stay, holding the sandbox at its limit. The first shell then becomes
    // `sleep` by exec (no fork left to fail) and stays to be timed out.
    // Everything is in the command's process group, orphans included.
    let mut command = CommandSpec::new([
        "sh",
        "-c",
        "(i=0; while [ $i -lt 100 ]; do sleep 30 & i=$((i+1)); done); exec sleep 30",
    ]);
    command.timeout = Some(Duration::from_secs(2));
    command.kill_grace = Duration::from_millis(200);
    let execution = t.sandbox.exec(&command).await.expect("exec");
    let waiter = tokio::spawn(execution.wait(|_: Stream, _: &[u8]| {}));

    let mut peak = 0;
    while !waiter.is_finished() {
        if let Some(current) = t.sandbox.cgroup_counters().pids_current {
            peak = peak.max(current);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let end = waiter.await.expect("join").expect("wait");
    assert_eq!(end.outcome, Outcome::TimedOut);
    assert!(peak <= 32, "{peak} pids in a sandbox limited to 32");
    assert!(peak >= 16, "the bomb never got going (peak {peak})");
    if let Some(events) = t
        .runtime
        .cgroups()
        .dir("pids", t.sandbox.cgroups_path())
        .and_then(|dir| std::fs::read_to_string(dir.join("pids.events")).ok())
    {
        let hits: u64 = events
            .lines()
            .find_map(|l| l.strip_prefix("max "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        assert!(hits > 0, "the pids limit was never hit: {events}");
    }
    // The bomb is gone and the sandbox is usable again.
    let settled = eventually(Duration::from_secs(10), || {
        t.sandbox
            .cgroup_counters()
            .pids_current
            .is_some_and(|n| n <= 2)
    })
    .await;
    assert!(
        settled,
        "bomb processes survived: {:?}",
        t.sandbox.cgroup_counters()
    );
    assert_eq!(t.sh_ok("echo alive").await, "alive\n");
}

#[tokio::test]
async fn an_oom_kill_is_resource_exhausted_for_the_command_not_the_sandbox() {
    let limits = Limits {
        memory_bytes: Some(64 * MIB),
        ..Limits::default()
    };
    let t = TestSandbox::start("oomcmd", limits).await;
    // `tail` keeps the last "line" of /dev/zero (there is no newline) in
    // memory: it grows until the limit kills it, and the shell reports the
    // SIGKILL as 137.
    let ran = t.sh("head -c 400000000 /dev/zero | tail").await;
    assert_eq!(
        ran.end.outcome,
        Outcome::ResourceExhausted,
        "{}",
        ran.stderr
    );
    assert!(t.sandbox.cgroup_counters().oom_kills.unwrap_or(0) >= 1);

    // The sandbox survived, and its later death is not blamed on that OOM.
    assert!(matches!(
        t.sandbox.observe().await.expect("observe"),
        Observation::Running { .. }
    ));
    let ran = t.sh("exit 137").await;
    assert_eq!(
        ran.end.outcome,
        Outcome::Exited { code: 137 },
        "137 without an OOM kill is the program's own"
    );
    let cause = t.sandbox.stop(Duration::from_secs(10)).await.expect("stop");
    assert_eq!(
        cause,
        DeathCause::WorkloadExited {
            end: Some(InitEnd::Stopped { signal: 15 })
        }
    );
}

#[tokio::test]
async fn a_workload_killed_by_oom_is_oom_killed() {
    let (dir, mut config) = prepare(
        "oomwl",
        Limits {
            memory_bytes: Some(64 * MIB),
            ..Limits::default()
        },
    );
    config.workload = vec!["tail".into(), "/dev/zero".into()];
    let t = TestSandbox::start_config(dir, config).await;
    let cause = tokio::time::timeout(Duration::from_secs(30), t.sandbox.wait_for_exit())
        .await
        .expect("the workload runs out of memory")
        .expect("wait_for_exit");
    assert_eq!(cause, DeathCause::OomKilled);
    assert_eq!(cause.reason(), "oom_killed");
    // The init said how its workload ended; the cgroup said why.
    let status = std::fs::read_to_string(t.config.paths.init_status()).expect("init status");
    assert_eq!(
        InitEnd::parse_last(&status),
        Some(InitEnd::WorkloadKilled { signal: 9 })
    );
    assert_eq!(
        t.sandbox.observe().await.expect("observe"),
        Observation::Stopped(DeathCause::OomKilled)
    );
}
